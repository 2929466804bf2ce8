"""Conversations: the caller's sessions of ``/v1/ask`` (list, read, delete). A session is its tenant's: another
tenant's id answers 404, as an unknown one does, so ids reveal nothing across tenants."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Response
from pydantic import BaseModel, Field

from app.api.deps import ServicesDep, TenantDep
from app.errors import ServiceError
from app.schemas import ID_PATTERN, ErrorResponse
from app.serving.sessions import Conversation

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])

SessionId = Annotated[str, Path(pattern=ID_PATTERN, description="The session_id given to (or by) /v1/ask")]
NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorResponse, "description": "No such session for this API key (or it expired)"}
}


class SessionNotFound(ServiceError):  # noqa: N818 (the API's error names)
    status, code = 404, "session_not_found"


class SessionSummary(BaseModel):
    id: str
    title: str = Field(description="The conversation's first question (cut to 200 characters)")
    created: float = Field(description="Unix time of its first question")
    updated: float = Field(description="Unix time of its last answer")
    turns: int = Field(description="Questions asked in it")


class SessionList(BaseModel):
    sessions: list[SessionSummary] = Field(description="Last written first")


class SessionTurn(BaseModel):
    question: str
    answer: str
    documents: list[str] = Field(description="The documents asked about")
    collection_ids: list[str] = Field(default_factory=list, description="The collections asked about")
    sources: list[dict[str, Any]] = Field(
        description="The sources shown with the answer, as /v1/ask sent them (empty when the server keeps none: "
        "RAGSPEC_SESSION_SOURCES=false)"
    )
    citations: dict[str, Any] | None = Field(
        None, description="The answer's citations of those sources, as the `citations` event of /v1/ask sent them "
        "(`citations`, `cited_answer`, `highlights`); null when sources are not kept"
    )


class SessionDetail(BaseModel):
    id: str
    title: str
    created: float
    updated: float
    asked: int = Field(description="Questions asked in it (its summary's `turns`)")
    turns: list[SessionTurn] = Field(
        description="Its last turns (at most 8), oldest first: the ones a follow-up question is asked after"
    )


def _summary(c: Conversation) -> SessionSummary:
    return SessionSummary(id=c.id, title=c.title, created=c.created, updated=c.updated, turns=c.asked)


@router.get("", response_model=SessionList)
async def list_sessions(
    services: ServicesDep,
    tenant: TenantDep,
    limit: Annotated[int, Query(ge=1, le=500, description="At most this many, last written first")] = 100,
) -> SessionList:
    """The caller's conversations that have not expired (``RAGSPEC_SESSION_TTL_S`` after their last answer)."""
    return SessionList(sessions=[_summary(c) for c in await services.sessions.recent(tenant, limit)])


@router.get("/{session_id}", response_model=SessionDetail, responses=NOT_FOUND)
async def get_session(session_id: SessionId, services: ServicesDep, tenant: TenantDep) -> SessionDetail:
    conversation = await services.sessions.get(tenant, session_id)
    if conversation is None:
        raise SessionNotFound(f"no session {session_id!r}")
    turns = [
        SessionTurn(question=t.question, answer=t.answer, documents=list(t.documents),
                    collection_ids=list(t.collections),
                    sources=[dict(s) for s in t.sources],
                    citations=dict(t.citations) if t.citations is not None else None)
        for t in conversation.turns
    ]
    c = conversation
    return SessionDetail(id=c.id, title=c.title, created=c.created, updated=c.updated, asked=c.asked, turns=turns)


@router.delete("/{session_id}", status_code=204, response_class=Response, responses=NOT_FOUND)
async def delete_session(session_id: SessionId, services: ServicesDep, tenant: TenantDep) -> Response:
    if not await services.sessions.delete(tenant, session_id):
        raise SessionNotFound(f"no session {session_id!r}")
    return Response(status_code=204)
