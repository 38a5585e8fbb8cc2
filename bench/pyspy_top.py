"""Summarise py-spy raw (collapsed-stack) files: per thread, the functions with the most samples
on top of the stack (self) and anywhere on it (inclusive).

    python bench/pyspy_top.py DIR/set.txt [--top 25]

(``bench/kv_bench.py --py-spy DIR`` writes these files.)
"""

import argparse
import collections
import re
import sys

_FRAME = re.compile(r"^(.*) \((.*?)(?::\d+)?\)$")


def frame_name(frame):
    m = _FRAME.match(frame)
    if not m:
        return frame
    func, path = m.groups()
    parts = path.split("/")
    return "%s (%s)" % (func, "/".join(parts[-2:]))


def summarise(path, top):
    threads = collections.defaultdict(lambda: (collections.Counter(), collections.Counter(), [0]))
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            stack, _, count = line.rpartition(" ")
            count = int(count)
            frames = stack.split(";")
            thread = frames[0] if frames[0].startswith(("thread ", "process ")) else "?"
            frames = [frame_name(fr) for fr in frames if not fr.startswith(("thread ", "process "))]
            own, incl, total = threads[thread]
            total[0] += count
            if frames:
                own[frames[-1]] += count
                for name in set(frames):
                    incl[name] += count
    for thread, (own, incl, total) in sorted(threads.items(), key=lambda t: -t[1][2][0]):
        n = total[0]
        print("== %s: %d samples" % (thread, n))
        print("   self:")
        for name, c in own.most_common(top):
            print("   %5.1f%%  %s" % (100.0 * c / n, name))
        print("   inclusive:")
        for name, c in incl.most_common(top):
            print("   %5.1f%%  %s" % (100.0 * c / n, name))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    for path in args.files:
        print("#", path)
        summarise(path, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
