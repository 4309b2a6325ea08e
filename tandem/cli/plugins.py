"""`tandem plugins`: list every strategy the plugin manager loaded — kind, name, the package it came
from, and its class — so a user can see what `--eviction`, `--kv-cache-dtype`, `--speculator`, ...
accept and which installed package provides each name."""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plugins", help="list loaded plugins (eviction, KV quantizers, speculators, ...)",
                       description="List every strategy by kind and name with the package that provides it "
                                   "(built-ins come from tandem-llm; others from the `tandem` entry-point group).")
    p.add_argument("--kind", default=None, help="only this kind (eviction, kv_quantizer, speculator, "
                                                "kv_connector, routing)")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(func=run)


def rows(kind: str | None = None) -> list[dict[str, str]]:
    from plugins.hookspecs import KIND_HOOKS
    from plugins.manager import collect

    if kind is not None and kind not in KIND_HOOKS:
        raise ValueError(f"unknown plugin kind {kind!r}; kinds: {', '.join(KIND_HOOKS)}")
    out = []
    for k in [kind] if kind else KIND_HOOKS:
        for name, entry in sorted(collect(k).items()):
            out.append({"kind": k, "name": name, "package": entry.source, "plugin": entry.plugin,
                        "class": f"{entry.cls.__module__}.{entry.cls.__qualname__}"})
    return out


def run(args: argparse.Namespace) -> int:
    table = rows(args.kind)
    if args.json:
        json.dump(table, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    cols = ["kind", "name", "package", "class"]
    widths = {c: max([len(c)] + [len(r[c]) for r in table]) for c in cols}
    print("  ".join(c.upper().ljust(widths[c]) for c in cols).rstrip())
    for r in table:
        print("  ".join(r[c].ljust(widths[c]) for c in cols).rstrip())
    from plugins.hookspecs import KIND_HOOKS

    empty = [k for k in ([args.kind] if args.kind else KIND_HOOKS) if not any(r["kind"] == k for r in table)]
    if empty:
        print(f"(nothing registered for: {', '.join(empty)})")
    return 0
