"""One module per training engine; each builds its launch command and its model/trainer."""
