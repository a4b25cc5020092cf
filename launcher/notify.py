"""Notifications: the recipe's `notify:` URLs, sent through Apprise (Slack, Discord, Telegram, ntfy, email and more,
one URL syntax each: https://appriseit.com/services/). The URLs hold secrets: named only by place (notify[i]), and
Apprise's own log, which may quote one, is silenced. A root leaf."""

from __future__ import annotations

import logging
from typing import Callable

from launcher.errors import RecipeError

SEND_TIMEOUT_S = 30  # one service's whole call (apprise.Apprise.notify `timeout`): a run's end never waits longer


def _apprise():
    import apprise

    # apprise/logger.py quotes URLs in some errors (url_to_dict); without a handler they would reach stderr
    quiet = logging.getLogger("apprise")  # apprise/logger.py LOGGER_NAME
    quiet.propagate = False
    if not quiet.handlers:
        quiet.addHandler(logging.NullHandler())
    return apprise


def check(urls: list[str]) -> None:
    """As the recipe loads: every URL one Apprise can send to (apprise 2.3.0 `Apprise.add` is False otherwise)."""
    if not urls:
        return  # apprise stays unimported: a recipe without notify: loads light
    apprise = _apprise()
    for i, url in enumerate(urls):
        if not apprise.Apprise().add(url):
            # the scheme only: the rest of the URL may hold the very token that is wrong
            shown = f"{url.split('://', 1)[0]}://..." if "://" in url else "a text without a scheme://"
            raise RecipeError(
                f"notify[{i}] ({shown}) is not a notification URL Apprise can send to (an unknown scheme, or a "
                "token, channel or address missing from it)",
                fix=f"correct notify[{i}] in the recipe as Apprise's page for the service shows it, e.g. "
                "slack://TokenA/TokenB/TokenC/#channel, discord://WebhookID/WebhookToken, tgram://BotToken/ChatID, "
                "ntfy://topic, mailtos://user:password@example.com (https://appriseit.com/services/), or remove it.",
            )


def send(urls: list[str], title: str, body: str, log: Callable[[str], None]) -> None:
    """One message to every URL; a failed send is logged by the URL's place, never raised."""
    if not urls:
        return
    try:
        apprise = _apprise()
    except ImportError as exc:
        log(f"notify: not sent, apprise is not installed ({exc})")
        return
    for i, url in enumerate(urls):
        try:
            sender = apprise.Apprise()
            sent = sender.add(url) and bool(sender.notify(body=body, title=title, timeout=SEND_TIMEOUT_S))
        except Exception as exc:  # a plugin's own error: the run is told, not ended (the URL is not in the line)
            sent, why = False, type(exc).__name__
        else:
            why = "the service did not accept it"
        log(f"notify[{i}]: sent" if sent else f"notify[{i}]: not sent ({why}); the run's outcome is unchanged")
