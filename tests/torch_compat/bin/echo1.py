#!/usr/bin/env python3
"""Prints ``{m} stdout|stderr from {RANK}`` for each m of the comma-separated msg, or exits
with ``--exitcode`` (torch's echo1)."""

import argparse
import os
import sys

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--exitcode", type=int, default=0)
    parser.add_argument("msg", type=str)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    if args.exitcode != 0:
        print(f"exit {args.exitcode} from {rank}", file=sys.stderr)
        sys.exit(args.exitcode)
    for m in args.msg.split(","):
        print(f"{m} stdout from {rank}")
        print(f"{m} stderr from {rank}", file=sys.stderr)
