"""Profiling tools: `extproc benchmark` measures a GPU deployment cell by cell, `extproc gen-profile` turns
the measurements into the profile the SLO router and the optimizer read. Both speak AIBrix's files
(`aibrix_benchmark` JSONL, `aibrix:profile_<model>_<deployment>` JSON), so either tool can read the other's.
"""
