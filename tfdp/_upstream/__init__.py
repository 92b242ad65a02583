"""Every touch of private TensorFlow and Keras API in tfdp, and nothing else.

Each module here works around one upstream bug or reaches one internal that
the public API lacks, names the upstream issue, checks the installed versions
it was written for, and has a canary test in `tests/_upstream/` that fails
when upstream changes or no longer needs it. `tests/test_upstream_boundary.py`
keeps private upstream API out of every other module.
"""
