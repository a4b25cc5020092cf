"""ftrun: from a fine-tuning recipe to a finished, exported model on a rented GPU box."""

__version__ = "0.1.0"
