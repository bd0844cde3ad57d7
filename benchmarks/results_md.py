"""``benchmarks/RESULTS.md`` from ``benchmarks/results/latest.json``: one line a workload
(fuser's default row, the fastest anchor, their ratio, fuser's % of its floor, the device,
the date and the command that measured it), then every row of each workload.

    python benchmarks/results_md.py [benchmarks/results/latest.json] [--out benchmarks/RESULTS.md]

fuser's row of a workload is its default call: the first row whose implementation starts
with ``fuser`` and is not ``static``, a forced ``schedule=`` or a ``probe``. An anchor is any
row not fuser's. The ratio is the anchor's time over fuser's (above 1: fuser is faster).
The floor is the one the benchmark wrote (bytes at the copy bandwidth for optimizer steps,
the fewest passes a rule allows where the file has ``pct_of_pass_floor``, the products'
flops for Muon and the loss); the date and the command come from the row's source file in
the same folder as ``latest.json`` where the row does not carry them.
"""

from __future__ import annotations

import argparse
import json
import os
import re

SCRIPTS = dict(loss="loss_bench", optim="optim_bench", state="state_bench", shaped="shaped_bench",
               muon="muon_bench", first_step="first_step", post="post_training_bench")  # fmt: skip
HERE = os.path.dirname(os.path.abspath(__file__))
NOT_DEFAULT = ("static", "schedule=", "probe")
ORDER = ("adamw_fp32", "adamw_bf16_", "lamb", "muon", "adafactor", "came", "adamw_q8", "adamw_bf16p", "lion",
         "soap", "psgdkron", "shampoo", "lce_gist", "lce_llama8b", "logprobs_rl", "distill_jsd", "dpo",
         "first_step")  # fmt: skip


def is_fuser(impl: str) -> bool:
    return impl.startswith("fuser")


def is_reference(impl: str) -> bool:
    """A benchmark's own yardstick (post_training_bench's), neither fuser's call nor an anchor."""
    return impl.startswith(("reference:", "floor:", "probe"))


def is_default(impl: str) -> bool:
    return is_fuser(impl) and not any(word in impl for word in NOT_DEFAULT)


def source_doc(folder: str, source: str, cache: dict) -> dict:
    if source not in cache:
        path = os.path.join(folder, source)
        cache[source] = {}
        if os.path.exists(path):
            with open(path) as f:
                cache[source] = json.load(f)
    return cache[source]


def command_of(doc: dict, source: str) -> str:
    command = doc.get("command") or doc.get("meta", {}).get("command")
    if not command:
        script = re.match(r"([a-z]+(?:_step)?)_", source)
        name = SCRIPTS.get(script.group(1) if script else "", "?")
        return f"python benchmarks/{name}.py (its flags are not recorded in {source})"
    return re.sub(r" --out \S+", "", command)  # where the machine wrote it is not part of the command


def loss_floor(doc: dict, row: dict):
    """loss_bench's GEMM floor of the row's workload (three T·H·V products at 783 TFLOP/s)."""
    for r in doc.get("rows", []):
        if r.get("workload") == row["workload"] and "gemm_floor_ms" in r:
            return r["gemm_floor_ms"]
    return None


def floor_pct(row: dict, doc: dict):
    for key in ("pct_of_pass_floor", "pct_of_floor"):
        if row.get(key) is not None:
            return row[key]
    floor = row.get("floor_ms") or loss_floor(doc, row)
    return round(100 * floor / row["ms"], 1) if floor else None


def summary(rows: list[dict], folder: str) -> list[dict]:
    """One dict a workload that has a fuser row, in the order of latest.json."""
    cache: dict = {}
    by_workload: dict[str, list[dict]] = {}
    for r in rows:
        by_workload.setdefault(r["workload"], []).append(r)
    out = []
    for workload, group in by_workload.items():
        fuser = next((r for r in group if is_default(r["impl"])), None) or next(
            (r for r in group if is_fuser(r["impl"])), None
        )
        if fuser is None:
            continue
        anchors = [r for r in group if not is_fuser(r["impl"]) and not is_reference(r["impl"])]
        # a ratio within one run where that run timed an anchor: runs on other hosts differ
        anchors = [r for r in anchors if r["source"] == fuser["source"]] or anchors
        anchor = min(anchors, key=lambda r: r["ms"]) if anchors else None
        doc = source_doc(folder, fuser["source"], cache)
        date = re.search(r"\d{4}-\d{2}-\d{2}", fuser["source"])
        out.append(
            dict(
                workload=workload,
                fuser=fuser,
                anchor=anchor,
                ratio=round(anchor["ms"] / fuser["ms"], 2) if anchor else None,
                pct_of_floor=floor_pct(fuser, doc),
                device=fuser["device"],
                date=date.group(0) if date else "",
                command=command_of(doc, fuser["source"]),
                rows=group,
            )
        )
    return sorted(
        out, key=lambda e: next((i for i, p in enumerate(ORDER) if e["workload"].startswith(p)), len(ORDER))
    )


def ms(value: float) -> str:
    if value >= 1e3:
        return f"{value / 1e3:.2f} s"
    return f"{value:.2f} ms" if value >= 1 else f"{value:.3g} ms"


def markdown(entries: list[dict], latest: str) -> str:
    lines = [
        "# Benchmark results",
        "",
        f"Generated by `python benchmarks/results_md.py` from `{latest}` (`make bench` on a CUDA",
        "machine runs the benchmarks, then writes both). fuser is its default call; the best anchor is",
        "the fastest other implementation timed in the same process; ratio = anchor time / fuser time",
        "(above 1: fuser is faster); % of floor is the floor's time over fuser's (the loss's floor: three",
        "T·H·V products at 783 TFLOP/s). How each benchmark measures and why: `benchmarks/NOTES.md`.",
        "",
        "![fastest anchor's time over fuser's, by workload](results/latest.png)",
        "",
        "| workload | fuser | best anchor | ratio | % of floor | device | date | command |",
        "|---|---|---|---|---|---|---|---|",
    ]
    main = [e for e in entries if "_option_" not in e["workload"]]
    options = [e for e in entries if "_option_" in e["workload"]]
    for e in main:
        f, a = e["fuser"], e["anchor"]
        anchor = f"{a['impl']} {ms(a['ms'])}" if a else "–"
        if a and a["source"] != f["source"]:
            anchor += f" (another run: `{a['source']}`)"
        ratio = f"{e['ratio']:.2f}x" if e["ratio"] else "–"
        pct = f"{e['pct_of_floor']}%" if e["pct_of_floor"] is not None else "–"
        lines.append(
            f"| `{e['workload']}` | {ms(f['ms'])} ({f['impl']}) | {anchor} | {ratio} | {pct} | "
            f"{e['device']} | {e['date']} | `{e['command']}` |"
        )
    if options:
        lines += ["", "## Loss options against plain cross-entropy (time only)", ""]
        lines += [
            "| workload | fuser | ms | over plain | device | date | command |",
            "|---|---|---|---|---|---|---|",
        ]
        for e in options:
            for r in e["rows"]:
                over = f"{100 * r['over_plain']:+.1f}%" if "over_plain" in r else "–"
                lines.append(
                    f"| `{e['workload']}` | {r['impl']} | {r['ms']:g} | {over} | {e['device']} | "
                    f"{e['date']} | `{e['command']}` |"
                )
    lines += ["", "## Every row", ""]
    for e in main:
        lines += [
            f"### `{e['workload']}`",
            "",
            "| implementation | ms | % of floor | held | source |",
            "|---|---|---|---|---|",
        ]
        for r in sorted(e["rows"], key=lambda r: r["ms"]):
            pct = r.get("pct_of_pass_floor", r.get("pct_of_floor"))
            held = (
                f"{r['peak_mib']:g} MiB extra" if "peak_mib" in r
                else f"{r['state_bytes_per_param']:g} B/param" if "state_bytes_per_param" in r
                else ""
            )  # fmt: skip
            lines.append(
                f"| {r['impl']} | {r['ms']:g} | {'' if pct is None else pct} | {held} | `{r['source']}` |"
            )
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("latest", nargs="?", default=os.path.join(HERE, "results", "latest.json"))
    ap.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
    args = ap.parse_args(argv)
    with open(args.latest) as f:
        rows = json.load(f)
    entries = summary(rows, os.path.dirname(os.path.abspath(args.latest)))
    root, latest = os.path.dirname(HERE), os.path.abspath(args.latest)
    shown = os.path.relpath(latest, root) if latest.startswith(root + os.sep) else args.latest
    with open(args.out, "w") as f:
        f.write(markdown(entries, shown))
    print(f"wrote {len(entries)} workloads to {args.out}")


if __name__ == "__main__":
    main()
