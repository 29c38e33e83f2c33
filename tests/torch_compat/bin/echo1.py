#!/usr/bin/env python3
"""Prints ``{msg} stdout|stderr from {RANK}``, or exits with ``--exitcode`` (torch's echo1)."""

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
    print(f"{args.msg} stdout from {rank}")
    print(f"{args.msg} stderr from {rank}", file=sys.stderr)
