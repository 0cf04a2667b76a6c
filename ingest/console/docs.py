"""The docs pages of the console (``/console/docs/<page>``): the project's ``docs/*.md``
rendered to HTML with markdown-it-py (raw HTML in the markdown is escaped, never passed
through: the CSP stays strict), each heading with the anchor :mod:`core.docs` links to, and
links between the pages and to their pictures kept inside the console."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.responses import FileResponse, Response
from starlette.routing import Route

from core import docs

if TYPE_CHECKING:
    from markdown_it.renderer import RendererHTML
    from markdown_it.token import Token
    from markdown_it.utils import EnvType, OptionsDict

    from ingest.console.base import Console, Visit


def routes(c: Console) -> list[Route]:
    return [
        c.get("/docs", docs_index),
        c.get("/docs/img/{name}", docs_image),
        c.get("/docs/{page}", docs_page),
    ]


def _folder(c: Console) -> Path | None:
    return docs.docs_dir(c.settings.console_docs_dir)


def _pages(folder: Path) -> list[tuple[str, str]]:
    """(stem, first heading) of each page, by name: each file read once per version (its
    mtime), not on every view of the index."""
    return [
        (path.stem, _title(str(path), path.stat().st_mtime_ns))
        for path in sorted(folder.glob("*.md"))
    ]


@lru_cache(maxsize=256)
def _title(path: str, mtime_ns: int) -> str:  # noqa: ARG001 (the cache's key: the file's version)
    with Path(path).open() as lines:
        first = next((ln for ln in lines if ln.startswith("# ")), "")
    return first.removeprefix("# ").strip() or Path(path).stem


async def docs_index(c: Console, v: Visit) -> Response:
    folder = _folder(c)
    if folder is None:
        return c.error(v, _MISSING, 404)
    return c.show(v, "docs.html", {"title": "Docs", "body": None, "pages": _pages(folder)})


async def docs_page(c: Console, v: Visit) -> Response:
    folder, page = _folder(c), v.request.path_params["page"]
    if folder is None:
        return c.error(v, _MISSING, 404)
    path = folder / f"{page}.md"
    if not docs.PAGE_NAME.fullmatch(page) or not path.is_file():
        return c.error(v, f"no docs page named {page!r}", 404)
    body = render(str(path), path.stat().st_mtime_ns)
    return c.show(v, "docs.html", {"title": page, "body": body, "pages": _pages(folder)})


async def docs_image(c: Console, v: Visit) -> Response:
    """A picture a page shows (a PNG of the docs folder, by plain name only)."""
    folder, name = _folder(c), v.request.path_params["name"]
    stem = name.removesuffix(".png")
    if folder is None or name == stem or not docs.PAGE_NAME.fullmatch(stem):
        return Response("not found", 404)
    path = folder / name
    if not path.is_file():
        return Response("not found", 404)
    return FileResponse(path, media_type="image/png")


_MISSING = (
    "the docs are not installed beside this server: set WEBHOOKS_CONSOLE_DOCS_DIR to the "
    "project's docs/ folder"
)


@lru_cache(maxsize=32)
def render(path: str, mtime_ns: int) -> str:
    """A page's HTML (cached per file version: ``mtime_ns`` is part of the key)."""
    from markdown_it import MarkdownIt  # noqa: PLC0415 (the docs pages only)

    md = MarkdownIt("commonmark", {"html": False}).enable("table")
    md.add_render_rule("heading_open", _heading_open)
    md.add_render_rule("link_open", _link_open)
    md.add_render_rule("image", _image)
    html: str = md.render(Path(path).read_text())
    return html


def _heading_open(
    self: RendererHTML, tokens: list[Token], idx: int, options: OptionsDict, env: EnvType
) -> str:
    inline = tokens[idx + 1]
    tokens[idx].attrSet("id", docs.slug(inline.content.replace("`", "")))
    return self.renderToken(tokens, idx, options, env)


def _link_open(
    self: RendererHTML, tokens: list[Token], idx: int, options: OptionsDict, env: EnvType
) -> str:
    token = tokens[idx]
    href = str(token.attrGet("href") or "")
    token.attrSet("href", local_href(href))
    return self.renderToken(tokens, idx, options, env)


def _image(
    self: RendererHTML, tokens: list[Token], idx: int, options: OptionsDict, env: EnvType
) -> str:
    token = tokens[idx]
    src = str(token.attrGet("src") or "")
    if "/" not in src and src.endswith(".png"):
        token.attrSet("src", f"/console/docs/img/{src}")
    result: Any = self.image(tokens, idx, options, env)
    return str(result)


def local_href(href: str) -> str:
    """A link of a docs page as the console serves it: another page of the folder
    (``retries.md#x``) becomes ``/console/docs/retries#x``; anything else is kept."""
    target, _, anchor = href.partition("#")
    if "/" in target or "://" in href or not target.endswith(".md"):
        return href
    stem = target.removesuffix(".md")
    if not docs.PAGE_NAME.fullmatch(stem):
        return href
    return f"/console/docs/{stem}" + (f"#{anchor}" if anchor else "")
