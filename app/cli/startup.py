"""What ``ragspec serve`` checks and loads before it serves, and the one line a start-up failure prints.

A start-up failure the user can fix stops the command before anything listens: exit status 2 and one line on stderr,
the cause and then what to do (``StartupFailure``, ``report``). In the order they are met: the catalogue database,
the port (bound at once, so a port in use is said before anything loads), the data dir, a model path that is not
there (before torch is imported), the target model (loaded before the app's other imports, the store and the
embedder, so a wrong ``RAGSPEC_TARGET_MODEL`` is said in seconds), then the rest of the services (the drafter's
model and vocabulary, the embedder, the KV budgets). Under uvicorn these would come out of the app's lifespan as a
traceback and "Application startup failed"; here the services are loaded first and handed to the app, whose
lifespan uses them (``app.main.lifespan``).

Only domain errors become that line: ``ModelLoadError`` (``ModelFileError`` when the model itself is wrong, which
adds the setting to change), ``VocabularyMismatch``, ``RetrievalError`` (``CatalogueUnavailable``,
``EmbedderUnavailable``, ...) and the OS refusing to bind or to create the data dir. Their traceback goes to the
log at DEBUG; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import logging
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from app.settings import Settings

if TYPE_CHECKING:
    from fastapi import FastAPI

    from app.services import Services
    from decoding.runtime.loader import LoadedModel

logger = logging.getLogger(__name__)

EXIT_STARTUP = 2  # every start-up failure's exit status (a bad setting's too: app.cli.main)
BACKLOG = 2048  # the listen backlog (uvicorn's default, which it passes again when it serves on the socket)
# what the model settings can name instead (ModelFileError's remedy)
MODEL_FORMS = {
    "target": "a GGUF file (llama, qwen2, qwen3, gemma2, gemma3, phi3), a local Hugging Face model dir or 'bundled'",
    "drafter": "'target', or to a GGUF file or local Hugging Face model dir with the target's vocabulary",
}


class StartupFailure(Exception):  # noqa: N818 (a failure, not an error of the code)
    """A start-up failure the user can fix: its message is the whole line, the cause and then what to do."""


def report(failure: StartupFailure) -> int:
    """Write ``failure``'s line to stderr (its cause's traceback to the log, seen at DEBUG); the exit status."""
    logger.debug("start-up failed", exc_info=failure)
    sys.stderr.write(f"ragspec: {failure}\n")
    sys.stderr.flush()
    return EXIT_STARTUP


def _where(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _reason(exc: OSError) -> str:
    """The OS's words for ``exc`` in lower case ("address already in use"), without errno numbers or paths."""
    text = exc.strerror or str(exc)
    return text[:1].lower() + text[1:]


# ---- the port -------------------------------------------------------------------------------------------


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` as uvicorn binds one (IPv6 for a host with ``:``, ``SO_REUSEADDR`` so a
    port left in TIME_WAIT is free), not listening yet: connections are refused until the service is loaded, as
    when uvicorn binds after its start-up, but a port that is taken stops the start before anything loads."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupFailure(f"cannot listen on {_where(host, port)}: {_reason(exc)}; {_bind_remedy(exc)}") from exc
    return sock


def _bind_remedy(exc: OSError) -> str:
    if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
        return "set --host or RAGSPEC_HOST to an address of this machine (127.0.0.1, 0.0.0.0 for every interface)"
    if exc.errno == errno.EADDRINUSE:
        return "stop what listens there, or choose another port with --port or RAGSPEC_PORT"
    if exc.errno == errno.EACCES:
        return "ports below 1024 need privileges: choose another port with --port or RAGSPEC_PORT"
    return "check --host / RAGSPEC_HOST and --port / RAGSPEC_PORT"


def listen(sock: socket.socket) -> None:
    """Start listening on the bound socket (two commands that bound one port at once: the second stops here)."""
    try:
        sock.listen(BACKLOG)
    except OSError as exc:
        host, port = sock.getsockname()[:2]
        raise StartupFailure(f"cannot listen on {_where(host, port)}: {_reason(exc)}; {_bind_remedy(exc)}") from exc


# ---- the data dir and the catalogue database ---------------------------------------------------------------


def check_data_dir(settings: Settings) -> None:
    """Create the data dir (what ``load_services`` does first) here, where a path that cannot be one is one line."""
    try:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StartupFailure(f"cannot create the data dir {settings.data_dir}: {_reason(exc)}; set RAGSPEC_DATA_DIR "
                             "(or --data-dir) to a directory ragspec can create and write") from exc


def check_database(settings: Settings) -> None:
    """Reach (and migrate) the catalogue database of ``RAGSPEC_DATABASE_URL``, if one is set, before anything else
    loads; its message names the database with the password hidden."""
    if not settings.database_url:
        return
    from retrieval.catalogue import Catalogue
    from retrieval.errors import CatalogueUnavailable

    try:
        Catalogue(settings.database_url).close()
    except CatalogueUnavailable as exc:
        raise StartupFailure(f"RAGSPEC_DATABASE_URL: {exc}; check the URL and that the database server is up "
                             "(unset, the catalogue is SQLite in the data dir)") from exc


# ---- the models and the rest of the services ----------------------------------------------------------------


def _model_failure(role: str, setting: str, spec: str, exc: Exception) -> str:
    """``cannot load the <role> model <spec>: <cause>``, and for a model that is itself wrong (``ModelFileError``)
    which setting names another one. The spec is left out where the cause names it already."""
    from decoding.errors import ModelFileError

    cause = str(exc)
    line = f"cannot load the {role} model{'' if spec in cause else ' ' + spec}: {cause}"
    if not isinstance(exc, ModelFileError):
        return line  # a setting's message (RAGSPEC_MAX_CONTEXT=..., RAGSPEC_CPU_ISA=...) or `ragspec models`
    return f"{line}; set {setting} to {MODEL_FORMS[role]}"


def _names_a_path(spec: str) -> bool:
    """Whether a model setting can only mean a local path: absolute, from ``.`` or ``~``, or a ``.gguf`` name
    (``load_model`` takes the same for paths, and more, a hub id being ``name`` or ``owner/name``)."""
    return Path(spec).is_absolute() or spec.startswith((".", "~")) or spec.endswith(".gguf")


def check_model_paths(settings: Settings) -> None:
    """A model setting naming a local file or dir that is not there, said before torch is imported (seconds sooner
    than the load would); what is there is read, and judged, by the load."""
    from decoding.errors import ModelFileError

    models = [("target", "RAGSPEC_TARGET_MODEL", settings.target_model)]
    if settings.drafter_model not in ("target", settings.target_model):
        models.append(("drafter", "RAGSPEC_DRAFTER_MODEL", settings.drafter_model))
    for role, setting, spec in models:
        path = Path(spec).expanduser()
        if _names_a_path(spec) and not path.exists():
            raise StartupFailure(_model_failure(role, setting, spec, ModelFileError(f"{path} does not exist")))


def load_target_model(settings: Settings) -> LoadedModel:
    """The target LM, loaded before anything else that is slow (the store, the embedder, the app's imports), so a
    wrong ``RAGSPEC_TARGET_MODEL`` is said in seconds."""
    from app.services import load_target
    from decoding.errors import ModelLoadError

    try:
        return load_target(settings)
    except ModelLoadError as exc:
        raise StartupFailure(_model_failure("target", "RAGSPEC_TARGET_MODEL", settings.target_model, exc)) from exc


def load_rest(settings: Settings, target: LoadedModel) -> Services:
    """The services around the loaded target (``load_services``): the drafter's LM, the embedder, the store, the KV
    cache and the worker threads."""
    from app.services import load_services
    from decoding.errors import ModelFileError, ModelLoadError, VocabularyMismatch
    from retrieval.errors import EmbedderUnavailable, RetrievalError

    try:
        return load_services(settings, target=target)
    except ModelFileError as exc:  # the target is loaded: the one other LM is the drafter's
        raise StartupFailure(_model_failure("drafter", "RAGSPEC_DRAFTER_MODEL", settings.drafter_model, exc)) from exc
    except VocabularyMismatch as exc:
        raise StartupFailure(f"{exc}; set RAGSPEC_DRAFTER_MODEL to 'target' or to a model of the target's "
                             "vocabulary") from exc
    except EmbedderUnavailable as exc:
        raise StartupFailure(f"{exc}; set RAGSPEC_EMBEDDING_MODEL to a local model dir, or to 'bundled' (installed by "
                             "`ragspec models`)") from exc
    except (ModelLoadError, RetrievalError) as exc:
        raise StartupFailure(f"cannot start: {exc}") from exc


@dataclass
class Prepared:
    """What ``prepare`` hands to uvicorn: the app with its services loaded, and the listening socket."""

    app: FastAPI
    socket: socket.socket

    def close_unserved(self) -> None:
        """Close the services if the app's lifespan never took them over (uvicorn stopped before serving); after a
        served run the lifespan has closed them and cleared ``app.state.services``."""
        services: Services | None = self.app.state.services
        if services is not None:
            self.app.state.services = None
            services.close()


def prepare(settings: Settings, host: str, port: int) -> Prepared:
    """Everything ``ragspec serve`` can fail on before it serves, cheapest first: the port, the data dir, the model
    paths, the target, the rest of the services (the catalogue database comes before, in ``app.cli.main``, for
    cluster mode too); then the socket listens. Raises ``StartupFailure``."""
    sock = bind(host, port)
    try:
        check_data_dir(settings)
        check_model_paths(settings)
        target = load_target_model(settings)
        from app.main import create_app

        services = load_rest(settings, target)
        try:
            listen(sock)
        except StartupFailure:
            services.close()
            raise
        app = create_app(settings, services)
    except BaseException:
        sock.close()
        raise
    return Prepared(app, sock)
