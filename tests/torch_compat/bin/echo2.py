#!/usr/bin/env python3
"""Raises a RuntimeError with ``--raises true`` (torch's echo2), without ``@record``."""

import argparse
import os

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--raises", type=bool, default=False)
    parser.add_argument("msg", type=str)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    if args.raises:
        raise RuntimeError(f"raised from {rank}")
    print(f"{args.msg} from {rank}")
