"""The run report's numbers, from known lengths and timings (no Prefect needed)."""

from tasks.report import length_histogram, run_report

SUMMARY = {"run": "r1", "version": "v1", "written_this_run": 6, "failed": 1, "already_present": 2,
           "duplicates": 0, "rejected": 3, "tokens_this_run": 1200}


def test_histogram_buckets_are_powers_of_two_with_inner_gaps_kept():
    assert length_histogram([20, 30, 33, 200]) == [("17-32", 2), ("33-64", 1), ("65-128", 0), ("129-256", 1)]
    assert length_histogram([16, 17]) == [("1-16", 1), ("17-32", 1)]
    assert length_histogram([]) == []


def test_report_states_throughput_lengths_and_where_time_went():
    report = run_report(SUMMARY, [20, 30, 33, 200, 300, 617], {"prompt preparation": 1.0, "extraction": 6.0,
                                                                "consolidation and exports": 1.0})
    assert "**200.0 tokens/s**, 1.00 samples/s over 6.0 s" in report
    assert "| 17-32 | 2 | `" + "#" * 40 + "` |" in report and "| 513-1024 | 1 | `" + "#" * 20 + "` |" in report
    assert "min 20, median 200, max 617" in report
    assert "| extraction | 6.00 | 75% |" in report and "| prompt preparation | 1.00 | 12% |" in report
    assert "6 samples written this run (1 failed, 2 already present, 0 duplicates, 3 rejected), 1,200 tokens" in report
    assert "Inside the extraction" not in report  # no stage times given


def test_report_splits_the_extraction_by_stage_per_sample():
    stages = {"server": 3.0, "dump wait": 0.6, "read and verify": 1.2, "shard write": 1.2}
    report = run_report(SUMMARY, [20, 30], {"extraction": 6.0}, stages)
    assert "| server | 0.500 | 50% |" in report and "| dump wait | 0.100 | 10% |" in report
    assert "| read and verify | 0.200 | 20% |" in report and "| shard write | 0.200 | 20% |" in report


def test_a_run_with_nothing_new_says_so():
    report = run_report({**SUMMARY, "written_this_run": 0, "tokens_this_run": 0}, [], {"extraction": 0.0})
    assert "No sample was extracted this run." in report and "tokens/s" not in report


def test_report_shows_throughput_over_time_as_batches_finished():
    report = run_report(SUMMARY, [20, 30], {"extraction": 6.0}, None, [(2.0, 4), (3.0, 8), (6.0, 9)])
    assert "## Throughput over time" in report
    assert "| 1 | 2.0 | 4 | 2.00 |" in report and "| 2 | 3.0 | 8 | 4.00 |" in report and "| 3 | 6.0 | 9 | 0.33 |" in report
