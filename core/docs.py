"""Where each topic is explained: the docs page and section a refusal or an error points to
(issue 36 item 4, "links from the console and from CLI errors to the relevant docs page").

The docs are the markdown files of the project's ``docs/`` folder. The CLI names a topic as
that file's path and anchor (``docs/operating.md#one-dead-letter-end-to-end``: what a reader
of the checkout or of the repository opens); the console serves the same files at
``/console/docs/<page>`` and links there. ``tests/test_docs_links.py`` holds every topic to a
heading that exists, so a renamed section fails the suite instead of leaving a dead link.

Pure: no I/O here (the console's page reads the files, :func:`docs_dir` only names the folder).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Topic:
    page: str  # the file's stem under docs/
    heading: str  # the section's heading as written ("" for the page's top)
    title: str  # what a link says

    @property
    def anchor(self) -> str:
        return slug(self.heading) if self.heading else ""

    @property
    def path(self) -> str:
        """The file and anchor in the project's tree (what the CLI prints)."""
        return f"docs/{self.page}.md" + (f"#{self.anchor}" if self.anchor else "")

    @property
    def href(self) -> str:
        """The console's page for it."""
        return f"/console/docs/{self.page}" + (f"#{self.anchor}" if self.anchor else "")


TOPICS: dict[str, Topic] = {
    "console": Topic("operating", "Operator console", "Operating it: the console"),
    "dead-letters": Topic("operating", "One dead letter, end to end", "Dead letters and replay"),
    "reconciliation": Topic(
        "operating",
        "Reconciliation: events the provider sent that never arrived",
        "Reconciliation",
    ),
    "watchdog": Topic(
        "provider-side", "The subscription watchdog", "The provider's view of each endpoint"
    ),
    "traces": Topic("operating", "Traces across the pipeline", "Traces"),
    "gaps": Topic("provider-side-gaps", "`webhooks reconcile` without SOURCE", "Intake gaps"),
    "gaps-command": Topic("provider-side-gaps", "`webhooks gaps`", "Intake gaps: webhooks gaps"),
    "sources": Topic("providers", "Providers", "Sources and providers"),
    "routes": Topic("routing", "", "Routing: event types and content filters"),
    "filters": Topic(
        "routing",
        "Saving a filter: checked once, nothing saved when it is wrong",
        "Content filters",
    ),
    "transforms": Topic(
        "routing", "Transforms: reshape or drop an event before its handler", "Transforms"
    ),
    "publish": Topic("routing", "Fan-out to a broker: the publish handler", "Publishing to AMQP"),
    "settings": Topic("providers", "Settings and secrets", "Settings and secrets"),
    "retention": Topic("retention", "", "Retention"),
    "drift": Topic("drift", "", "Payload shape drift"),
    "ledger": Topic("retention", "The processed-events ledger", "The processed-events ledger"),
    "retries": Topic("retries", "", "Retry timing"),
    "workers": Topic("workers", "", "Workers"),
    "security": Topic("security", "", "Security"),
    "handlers": Topic("handlers", "", "Writing a handler"),
}

# The docs pages the console serves: every file stem a topic names, and the rest of docs/.
PAGE_NAME = re.compile(r"[a-z][a-z0-9_-]{0,40}")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub and the console's page make it: lower case, punctuation
    dropped, spaces as hyphens (``Reconciliation: events...`` -> ``reconciliation-events...``)."""
    kept = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return kept.replace(" ", "-")


def see(topic: str) -> str:
    """The line a CLI error ends with: ``see docs/<page>.md#<anchor>``."""
    return f"see {TOPICS[topic].path}"


def docs_dir(configured: Path | None) -> Path | None:
    """The folder of the docs' markdown: the setting when given, else the checkout's ``docs/``
    beside the packages (a clone, an editable install, the image's /app/docs); None when
    neither exists (a wheel installed without the docs)."""
    if configured is not None:
        return configured if configured.is_dir() else None
    beside = Path(__file__).resolve().parents[1] / "docs"
    return beside if beside.is_dir() else None
