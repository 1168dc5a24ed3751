"""The lab: the elastic training story on one machine (``local``), the user's tools around a
real run on Azure (``azure``), and what both share: the run as it happens (``live``) and its
report (``report``). ``python -m lab`` (``cli``) is the one entry to all of it."""
