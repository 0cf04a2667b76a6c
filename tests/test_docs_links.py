"""Issue 36 item 4: links from the console and from CLI errors to the docs page that explains
them. Every topic must land on a heading that exists (a renamed section fails here, not as a
dead link), the console serves the pages with those anchors, and a command's error names its
section."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from core import docs
from ingest.console.base import docs_for
from ingest.console.docs import local_href, render
from webhooks.cli.common import docs_topic, with_docs

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(docs.TOPICS))
def test_every_topic_lands_on_a_heading_of_its_page(name: str) -> None:
    topic = docs.TOPICS[name]
    page = ROOT / "docs" / f"{topic.page}.md"
    assert page.is_file(), topic.path
    html = render(str(page), page.stat().st_mtime_ns)
    if topic.anchor:
        assert f'id="{topic.anchor}"' in html, f"{topic.path}: no such heading"
        headings = [ln.lstrip("#").strip() for ln in page.read_text().splitlines()]
        assert topic.heading in headings
    assert topic.href.startswith(f"/console/docs/{topic.page}")


def test_the_checkouts_docs_folder_is_found_and_a_missing_setting_is_none(tmp_path: Path) -> None:
    assert docs.docs_dir(None) == ROOT / "docs"
    assert docs.docs_dir(tmp_path) == tmp_path
    assert docs.docs_dir(tmp_path / "absent") is None


def test_headings_slug_as_github_does() -> None:
    assert docs.slug("One dead letter, end to end") == "one-dead-letter-end-to-end"
    assert docs.slug("Reconciliation: events the provider sent that never arrived") == (
        "reconciliation-events-the-provider-sent-that-never-arrived"
    )
    assert docs.slug("Settings and secrets") == "settings-and-secrets"


def test_pages_link_to_each_other_inside_the_console_and_escape_raw_html(tmp_path: Path) -> None:
    assert local_href("retries.md#the-default-schedule") == (
        "/console/docs/retries#the-default-schedule"
    )
    assert local_href("providers.md") == "/console/docs/providers"
    assert local_href("https://example.com/x.md") == "https://example.com/x.md"
    assert local_href("../README.md") == "../README.md"
    assert local_href("#here") == "#here"
    page = tmp_path / "p.md"
    page.write_text("# Title `code`\n\n<script>alert(1)</script>\n\n![shot](shot.png)\n")
    html = render(str(page), 1)
    assert "<script>" not in html
    assert "&lt;script&gt;" in html
    assert '<h1 id="title-code">' in html
    assert 'src="/console/docs/img/shot.png"' in html


@pytest.mark.parametrize(
    ("path", "topic"),
    [
        ("/console/dead/confirm", "dead-letters"),
        ("/console/replays/7/cancel", "dead-letters"),
        ("/console/deliveries/5/replay", "dead-letters"),
        ("/console/sources/src_x/pause", "sources"),
        ("/console/routes", "routes"),
        ("/console/ledger", "ledger"),
        ("/console/events/9", "console"),
        ("/console/", "console"),
    ],
)
def test_a_console_refusal_links_to_the_section_of_its_page(path: str, topic: str) -> None:
    assert docs_for(path) == docs.TOPICS[topic]


class KeyMismatch(Exception):  # noqa: N818 (named as core.crypto's, which the table matches)
    pass


def _dead_list() -> None: ...


def _sources_add() -> None: ...


_sources_add.__module__ = "webhooks.cli.sources"
_dead_list.__name__ = "dead_list"


def test_a_cli_error_names_its_docs_section_on_the_same_line() -> None:
    assert docs_topic(_dead_list, ValueError()) == "dead-letters"
    assert docs_topic(_sources_add, ValueError()) == "sources"
    assert docs_topic(_sources_add, KeyMismatch()) == "security"
    assert docs_topic(test_headings_slug_as_github_does, ValueError()) is None
    line = with_docs("no such source", "sources")
    assert line == "no such source (see docs/providers.md#providers)"
    assert "\n" not in line
    assert re.fullmatch(r"[^()]+ \(see docs/\w+\.md(#[\w-]+)?\)", line)
    assert with_docs("x", None) == "x"
