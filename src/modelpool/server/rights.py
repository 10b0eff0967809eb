"""What an ordinary tenant may do and what only an operator may: the one place the daemon
decides it, so that every route asks the same question.

An operator is a tenant marked ``admin = true`` in ``keys_file``; a daemon without a keys
file has no tenants to keep apart, and whoever it lets in is its operator
(``tenants.Keys.operates``). Only an operator loads and unloads models and sees ``/stats``
(so the status page) in full; an ordinary tenant gets 403 ``operator_only`` on those
routes, and a view of ``/stats`` and ``/v1/models`` without the operator's model paths or
the raw text of load errors (which may name paths, hosts or tokens: they go to the log
and to operators), each failed model's reason cut to its class, in a request's 503 too::

    @app.post("/models/load", dependencies=[OPERATOR_ONLY])
    if operates(request): ...                       # the caller is an operator
    body = stats if operates(request) else tenant_stats(stats)
"""

from __future__ import annotations

from typing import Any

from fastapi import Depends, Request

from modelpool.server.http import ApiError
from modelpool.server.tenants import Keys, Tenant
from modelpool.shared.errors import ModelUnavailable, PoolError

# A registry's reasons, by how they start or what they hold, and the class a tenant sees.
_REASON_CLASSES = (
    ("its load did not", "its load timed out"),
    ("memory not released", "memory was not released"),
    ("its memory was not released", "memory was not released"),
    ("its load failed", "its load failed"),
    ("its pool died", "its workers stopped"),
)
_TOO_LARGE = "too large for the memory budget"
UNAVAILABLE = "unavailable (the operator's log says why)"
# What a pool's /stats holds that only an operator sees.
_OPERATOR_POOL_FIELDS = ("last_load_error", "backend_reason")


def caller(request: Request) -> Tenant | None:
    """The tenant whose key the request carries (None: no key, or no keys at all)."""
    keys = _keys(request)
    headers = request.headers
    return keys.tenant(
        headers.get("authorization", "").encode("latin-1"),
        headers.get("x-api-key", "").encode("latin-1"),
    )


def operates(request: Request) -> bool:
    """Whether the request comes from an operator."""
    return _keys(request).operates(caller(request))


def owner(request: Request) -> str:
    """Whose stored responses the request reads and writes: its tenant's ("" without keys,
    where every caller is one)."""
    tenant = caller(request)
    return tenant.name if tenant is not None else ""


def known(request: Request) -> bool:
    """Whether the request's key names a tenant, or the daemon takes requests without one."""
    keys = _keys(request)
    return not keys.required or caller(request) is not None


async def require_operator(request: Request) -> None:
    """403 ``operator_only`` for an ordinary tenant (the Gate has refused a bad key)."""
    if not operates(request):
        raise ApiError(
            403,
            f"{request.method} {request.url.path} is for operators: a key of a tenant "
            "marked admin = true in keys_file",
            type="permission_error",
            code="operator_only",
        )


OPERATOR_ONLY = Depends(require_operator)


def short_reason(reason: str | None) -> str | None:
    """The class of a model's failure, as a tenant sees it (the text is the operator's)."""
    if reason is None:
        return None
    for start, short in _REASON_CLASSES:
        if reason.startswith(start):
            return short
    if "budget" in reason:
        return _TOO_LARGE
    return UNAVAILABLE


def tenant_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """``/stats`` as an ordinary tenant sees it: a pool's or a registry's, without model
    paths, load errors' text or why a backend was chosen (a copy; ``stats`` is kept)."""
    view = dict(stats)
    for field in _OPERATOR_POOL_FIELDS:
        if field in view:
            view[field] = None
    models = stats.get("models")
    if isinstance(models, dict):
        view["models"] = {name: _tenant_model(model) for name, model in models.items()}
    return view


def tenant_card(card: dict[str, Any]) -> dict[str, Any]:
    """A ``/v1/models`` entry as an ordinary tenant sees it: the reason cut to its class."""
    return {**card, "reason": short_reason(card.get("reason"))}


def seen_error(request: Request, error: PoolError) -> PoolError:
    """``error`` as the caller may see it: a tenant learns a failed model's class of
    failure, not the load error's text (the log and an operator have it)."""
    if not isinstance(error, ModelUnavailable) or operates(request):
        return error
    reason = short_reason(error.reason) or UNAVAILABLE
    return ModelUnavailable(
        f"model {error.model!r} is unavailable: {reason}",
        model=error.model,
        reason=reason,
        retry_after_s=error.retry_after_s,
    )


def _tenant_model(model: dict[str, Any]) -> dict[str, Any]:
    view = {key: value for key, value in model.items() if key != "model"}
    view["reason"] = short_reason(model.get("reason"))
    pool = model.get("pool")
    if isinstance(pool, dict):
        view["pool"] = tenant_stats(pool)
    return view


def _keys(request: Request) -> Keys:
    keys = request.app.state.modelpool.keys
    assert isinstance(keys, Keys)
    return keys
