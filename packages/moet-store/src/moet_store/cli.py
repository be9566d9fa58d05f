"""``moet-store`` console script: ``doctor [DIR] [--json]``, ``ls [DIR]``, ``prune DIR --cap N``."""

from __future__ import annotations

import argparse
import json
import sys

from . import __version__
from .doctor import doctor, format_doctor
from .pack import list_packs, prune


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="moet-store", description="moet pack store tools")
    ap.add_argument("--version", action="version", version=f"moet-store {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("doctor", help="engine, reason, O_DIRECT, memlock, free space")
    d.add_argument("dir", nargs="?", default=None, help="pack directory (default: cache dir)")
    d.add_argument("--json", action="store_true", help="print the dict as JSON")
    ls = sub.add_parser("ls", help="list packs")
    ls.add_argument("dir", nargs="?", default=None)
    pr = sub.add_parser("prune", help="delete stale packs beyond a size cap")
    pr.add_argument("dir")
    pr.add_argument("--cap", type=int, required=True, help="cap in bytes")
    pr.add_argument("--keep", action="append", default=[], help="identity hash to keep")
    args = ap.parse_args(argv)
    if args.cmd == "doctor":
        info = doctor(args.dir)
        print(json.dumps(info, indent=2, default=str) if args.json else format_doctor(info))
    elif args.cmd == "ls":
        for p in list_packs(args.dir):
            print(f"{p['name']}\t{p['size']}\t{p.get('layers_written')}")
    elif args.cmd == "prune":
        for p in prune(args.dir, args.cap, args.keep):
            print(f"removed {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
