"""Spark's automatic registration hook for the ``sbp`` data source (see node/spark/__init__.py).

At session start Spark imports every top-level ``pyspark_*`` module it finds and registers its
``DefaultSource``. An exception here would break that lookup for every Python data source in the
session, so a failed import only leaves ``DefaultSource`` undefined (``node.spark.register`` still
reports the real error).
"""

try:
    from node.spark.source import SbpDataSource as DefaultSource  # noqa: F401
except Exception:  # pragma: no cover - an environment without pyspark/pyarrow or the node package
    pass
