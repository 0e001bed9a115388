"""The benchmarks: `python -m benchmarks` (see __main__.py); common.py
measures, bench_<op>.py lists each op's cases."""
