"""PySpark data source ``sbp``: read and write node streams over the SBP client protocol (CONTRACT §8).

    import node.spark
    node.spark.register(spark)          # once per SparkSession
    df = (spark.read.format("sbp").option("endpoint", "host:7700")
          .option("streams", "4294967297").load())

With the project installed, Spark also registers it by itself at session start through the top-level
``pyspark_sbp`` module (Spark's ``pyspark_*`` / ``DefaultSource`` convention). See docs/spark.md.
"""

SOURCE_NAME = "sbp"


def register(spark):
    """Register the ``sbp`` format on ``spark`` (a SparkSession); returns the DataSource class."""
    from node.spark.source import SbpDataSource

    spark.dataSource.register(SbpDataSource)
    return SbpDataSource


__all__ = ["register", "SOURCE_NAME"]
