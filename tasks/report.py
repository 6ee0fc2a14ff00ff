"""The run report a person reads in the Prefect UI (a markdown artifact): how long the samples
were, how fast they went, and where the run's time went."""

from __future__ import annotations

from collections.abc import Sequence

BAR_WIDTH = 40


def length_histogram(lengths: Sequence[int]) -> list[tuple[str, int]]:
    """``(bucket, count)`` over power-of-two buckets ("1-16", "17-32", ...), empty buckets inside
    the range kept so that the shape reads right."""
    if not lengths:
        return []
    top = 16
    while top < max(lengths):
        top *= 2
    rows, low, high = [], 1, 16
    while high <= top:
        rows.append((f"{low}-{high}", sum(low <= n <= high for n in lengths)))
        low, high = high + 1, high * 2
    while rows and rows[0][1] == 0:
        rows.pop(0)
    return rows


def run_report(summary: dict, lengths: Sequence[int], phases_s: dict[str, float],
               stages_s: dict[str, float] | None = None, finished: Sequence[tuple[float, int]] = ()) -> str:
    """Markdown: the summary's throughput, a histogram of this run's sample lengths (tokens), the
    run's wall time by phase and, inside the extraction, the samples' time by stage
    (``tasks.retrieval.StageTimes``: summed over samples, which overlap), and the throughput over time
    from ``finished``: (seconds since the extraction began, samples done) as batches finished."""
    tokens, seconds = summary["tokens_this_run"], phases_s.get("extraction", 0.0)
    lines = [f"# Run {summary['run']}: dataset version {summary['version']}", "",
             f"{summary['written_this_run']} samples written this run ({summary['failed']} failed, "
             f"{summary['already_present']} already present, {summary['duplicates']} duplicates, "
             f"{summary['rejected']} rejected), {tokens:,} tokens.", ""]
    if seconds > 0 and lengths:
        lines += [f"Throughput: **{tokens / seconds:,.1f} tokens/s**, {len(lengths) / seconds:,.2f} samples/s "
                  f"over {seconds:,.1f} s of extraction (server start included).", ""]
    lines += ["## Sample lengths (tokens, this run)", ""]
    histogram = length_histogram(lengths)
    if histogram:
        most = max(count for _, count in histogram)
        lines += ["| tokens | samples | |", "|---:|---:|:---|"]
        lines += [f"| {bucket} | {count} | `{'#' * round(BAR_WIDTH * count / most)}` |" for bucket, count in histogram]
        ordered = sorted(lengths)
        lines += ["", f"min {ordered[0]}, median {ordered[len(ordered) // 2]}, max {ordered[-1]}"]
    else:
        lines.append("No sample was extracted this run.")
    if finished:
        lines += ["", "## Throughput over time", "", "| batches finished | after (s) | samples done | "
                  "samples/s since the last |", "|---:|---:|---:|---:|"]
        previous = (0.0, 0)
        for n, (at, done) in enumerate(finished, start=1):
            rate = (done - previous[1]) / (at - previous[0]) if at > previous[0] else 0.0
            lines.append(f"| {n} | {at:,.1f} | {done} | {rate:,.2f} |")
            previous = (at, done)
    total = sum(phases_s.values())
    lines += ["", "## Where the time went", "", "| phase | seconds | share |", "|---|---:|---:|"]
    lines += [f"| {name} | {s:,.2f} | {100 * s / total if total else 0:.0f}% |" for name, s in phases_s.items()]
    samples = summary["written_this_run"]
    stage_total = sum((stages_s or {}).values())
    if stage_total > 0 and samples:
        lines += ["", "### Inside the extraction, per sample", "",
                  "Samples run side by side, so these add up to more than the wall time; the shares "
                  "say what a sample waited on: the server's forward, its dump landing, reading and "
                  "verifying the dump, writing it into the shard.", "",
                  "| stage | seconds a sample | share |", "|---|---:|---:|"]
        lines += [f"| {name} | {s / samples:,.3f} | {100 * s / stage_total:.0f}% |" for name, s in stages_s.items()]
    return "\n".join(lines) + "\n"
