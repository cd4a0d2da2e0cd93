"""
Times one command under two environments, interleaved (A, B, A, B, ...), for settings that only take
effect when a process starts (an allocator, a thread count, an ISA limit): the median of the per-round
wall-time ratios, so load on the shared machine hits both sides alike.

  python tools/ab_env.py --a SMALLGPT_MALLOC=0 --b SMALLGPT_MALLOC=1 --rounds=5 -- python train.py ...

Each side's runs must succeed; their last output lines are compared, so a setting that changed the
results (not only the speed) is reported as such.
"""

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time


def env_of(assignments):
    env = dict(os.environ)
    for item in assignments:
        name, sep, value = item.partition("=")
        if not sep:
            sys.exit(f"error: {item!r} is not NAME=VALUE")
        env[name] = value
    return env


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", nargs="*", default=[], help="NAME=VALUE settings of side A")
    parser.add_argument("--b", nargs="*", default=[], help="NAME=VALUE settings of side B")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        sys.exit("error: give the command after --")
    sides = {"A": env_of(args.a), "B": env_of(args.b)}
    times, last = {"A": [], "B": []}, {}
    for r in range(args.rounds):
        for side, env in sides.items():
            start = time.perf_counter()
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            times[side].append(time.perf_counter() - start)
            if done.returncode != 0:
                sys.exit(f"error: side {side} exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
            last[side] = (done.stdout.strip().splitlines() or [""])[-1]
        print(f"round {r + 1}: A {times['A'][-1]:.2f} s, B {times['B'][-1]:.2f} s", flush=True)
    ratios = [a / b for a, b in zip(times["A"], times["B"])]
    print(f"command: {shlex.join(command)}")
    print(f"A {' '.join(args.a)}: median {statistics.median(times['A']):.2f} s")
    print(f"B {' '.join(args.b)}: median {statistics.median(times['B']):.2f} s")
    print(f"A/B wall-time ratio: median {statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f}, "
          f"{args.rounds} rounds)")
    print("last output lines", "equal" if last["A"] == last["B"] else f"differ:\n  A: {last['A']}\n  B: {last['B']}")


if __name__ == "__main__":
    main()
