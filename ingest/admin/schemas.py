"""The admin API's request and response bodies (the schema's components keep these names)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from models import queries, replays
from models.candidates import Candidate
from models.replays import ReplayRecord

# Numeric inputs within their column's range (a bigint), or 400 like any other bad input:
# text ids and times go through models.queries (parse_id, parse_time) the same way.
RowId = Annotated[int, Field(ge=1, le=queries.MAX_ID)]


class PauseIn(BaseModel):
    """Pause or resume a route (audited, the token's name as the operator)."""

    model_config = ConfigDict(extra="forbid")

    reason: str = Field(min_length=1, description="Why (required; recorded in the audit).")


class RouteUpdateIn(BaseModel):
    """Change a route's routing (audited, the token's name as the operator): only the fields
    given change; `null` clears a filter, a transform or an order key. The checks of
    `webhooks routes update`; when one fails nothing is saved."""

    model_config = ConfigDict(extra="forbid")

    reason: str = Field(min_length=1, description="Why (required; recorded in the audit).")
    filter: str | None = Field(
        default=None, description="JMESPath over body, type and headers; null clears it."
    )
    transform: str | None = Field(
        default=None, description="A registered transform's name; null clears it."
    )
    order_key: str | None = Field(
        default=None, description="JMESPath whose value is the event's lane; null: unordered."
    )
    lane_on_dead: Literal["block", "skip"] | None = Field(
        default=None, description="What a dead event does to its lane: `block` or `skip`."
    )
    supersede: bool | None = Field(
        default=None, description="Record stale events of a key `superseded` (needs order_key)."
    )

    @field_validator("reason", "filter", "transform", "order_key")
    @classmethod
    def _storable(cls, value: str | None) -> str | None:
        if value is not None and "\x00" in value:
            raise ValueError("NUL characters are not allowed (Postgres text cannot hold them)")
        return value


class ReplayIn(BaseModel):
    """A replay: delivery ids, or a filter. Same rules as `webhooks replay`."""

    model_config = ConfigDict(extra="forbid")

    reason: str = Field(min_length=1, description="Why (required; recorded in the audit).")
    ids: list[RowId] | None = Field(
        default=None, min_length=1, description="Delivery ids. Excludes the filter fields."
    )
    source: str | None = Field(default=None, description="Filter: source id or name.")
    type: str | None = Field(default=None, description="Filter: event type, globs allowed.")
    status: str = Field(
        default="dead", description="Filter: `dead`, or `succeeded` with rerun_succeeded."
    )
    since: str | None = Field(
        default=None, description="Filter: received at or after (ISO time, or `2h` ago)."
    )
    until: str | None = Field(
        default=None, description="Filter: received before (ISO time, or `30m` ago)."
    )
    rerun_succeeded: bool = Field(
        default=False,
        description="Allow succeeded deliveries to run again, under a new downstream key.",
    )
    rate: float = Field(
        default=replays.DEFAULT_RATE,
        gt=0,
        le=replays.MAX_RATE,
        description="At most this many replays per second.",
    )
    dry_run: bool = Field(default=False, description="Preview only: count and sample.")

    @field_validator("reason", "source", "type", "status", "since", "until")
    @classmethod
    def _storable(cls, value: str | None) -> str | None:
        if value is not None and "\x00" in value:
            raise ValueError("NUL characters are not allowed (Postgres text cannot hold them)")
        return value


class PreviewOut(BaseModel):
    """What the replay covers: frozen when planned, so this count is what runs."""

    count: int
    by_status: dict[str, int]
    without_payload: int = Field(description="Candidates whose payload retention dropped.")
    sample: list[Candidate]


class ReplayCreatedOut(BaseModel):
    """The preview, and the audit row when the replay started (null for a dry run or 0)."""

    preview: PreviewOut
    replay: ReplayRecord | None


class ErrorOut(BaseModel):
    """An error with a machine-readable reason."""

    detail: str
    reason: str


def preview(plan: replays.Plan) -> PreviewOut:
    return PreviewOut(
        count=plan.count,
        by_status=plan.by_status,
        without_payload=plan.without_payload,
        sample=list(plan.sample),
    )


# The answer of a route that shows or changes one row, when there is no such row.
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": ErrorOut}}
