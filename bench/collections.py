"""Collections benchmark: asking over a collection of many documents, section by section.

    python -m bench.collections [--sections search] [--sizes 10000,100000,1000000] [--quick] [--json PATH] [--fresh]

Sections (``--sections``, comma-separated; each run merges the sections it measured into the JSON already at
``--json``, keeping the others, unless ``--fresh``):

* ``search`` (bench/collections_search.py): ``retrieval.collection_index.CollectionIndex`` at 10K, 100K and 1M
  synthetic chunks: build time one document at a time, the add of one more document at full size, resident memory
  per chunk, search p50 / p99 and recall@10 against brute force for k = 10 and 64 without a filter and with filters
  allowing 10 % and 1 % of the documents, FTS5 candidates' latency, removal and compaction; the real embedder's
  query time apart; and the sweep of the index's knobs at 100K its defaults come from. ``--quick``: 10K only,
  no sweep (under a minute).

A section is a function ``run(args, save) -> dict`` in ``SECTIONS`` (its own options added by ``add_arguments``);
``save(partial)`` writes what it has measured so far (a long run keeps it). The JSON: ``benchmark``, ``machine``
(``bench.common.machine_info``: CPU, its flags, threads), ``started``, ``sections`` (name -> the section's result,
each with its own ``machine`` and ``started``: a merged file may hold sections measured on different runs; a
section's ``merge_keys``, e.g. search's ``sizes``, merge entry by entry, so a 1M run keeps the 100K figures) and
``runs`` (each run's sections and command line).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import collections_search, collections_service
from bench.common import REPO, machine_info, out, write_json

DEFAULT_JSON = REPO / "bench" / "results" / "collections.json"


@dataclass(frozen=True)
class Section:
    run: Callable[[argparse.Namespace, Callable[[dict[str, Any]], None]], dict[str, Any]]
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    merge_keys: tuple[str, ...] = ()  # dict entries of the result merged key by key into the JSON's (not replaced)


SECTIONS: dict[str, Section] = {
    "search": Section(collections_search.run, collections_search.add_arguments,
                      merge_keys=("sizes", "sweeps")),
    # bench/collections_service.py: a real server over HTTP (its options added once, with ingest's)
    "ingest": Section(collections_service.run_ingest, collections_service.add_arguments),
    "quality": Section(collections_service.run_quality),
    "ttft": Section(collections_service.run_ttft),
}


def merge_section(old: dict[str, Any], new: dict[str, Any], merge_keys: Sequence[str]) -> dict[str, Any]:
    """A section's new result over its old one: its entries replace the old ones (those it lacks are kept), and
    each of ``merge_keys`` (e.g. search's ``sizes``) is merged key by key (a 1M run keeps the 100K figures)."""
    merged = {**old, **new}
    for key in merge_keys:
        if isinstance(old.get(key), dict) and isinstance(new.get(key), dict):
            merged[key] = {**old[key], **new[key]}
    return merged


def _machine() -> dict[str, Any]:
    import faiss

    info = machine_info()
    info["faiss"] = faiss.__version__
    info["faiss_omp_threads"] = faiss.omp_get_max_threads()
    info["load_average"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return info


def _sections(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown sections {unknown}; known: {sorted(SECTIONS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--sections", type=_sections, default=list(SECTIONS), help=f"of {', '.join(SECTIONS)}")
    p.add_argument("--quick", action="store_true", help="each section's quick form (search: 10K only, no sweep)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    p.add_argument("--fresh", action="store_true", help="write a new JSON instead of merging into the one there")
    for section in SECTIONS.values():
        if section.add_arguments is not None:
            section.add_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    previous: dict[str, Any] = {}
    if not args.fresh and args.json.is_file():
        previous = json.loads(args.json.read_text(encoding="utf-8"))
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    machine = _machine()
    doc: dict[str, Any] = {**previous, "benchmark": "collections", "machine": machine, "started": started}
    doc.setdefault("sections", {})
    doc["runs"] = [*previous.get("runs", []), {"started": started, "sections": args.sections, "quick": args.quick,
                                               "argv": list(sys.argv[1:] if argv is None else argv)}]
    out(f"collections benchmark: sections {args.sections} -> {args.json}")
    this_run, saved = doc["runs"][-1], set()
    for name in args.sections:
        began = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        old = doc["sections"].get(name, {})

        def save(partial: dict[str, Any], name: str = name, began: str = began, old: dict[str, Any] = old) -> None:
            new = {"started": began, "quick": args.quick, "machine": machine, **partial}
            doc["sections"][name] = merge_section(old, new, SECTIONS[name].merge_keys)
            saved.add(name)
            if not args.fresh and args.json.is_file():  # another run may have written its sections meanwhile
                latest = json.loads(args.json.read_text(encoding="utf-8"))
                sections = {**latest.get("sections", {}), **{n: doc["sections"][n] for n in saved}}
                runs = [r for r in latest.get("runs", []) if r != this_run]
                doc.update(sections=sections, runs=[*runs, this_run])
            write_json(args.json, doc)

        result = SECTIONS[name].run(args, save)
        save({**result, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    out(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
