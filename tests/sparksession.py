"""One local[2] SparkSession for a test module (starting one costs ~5 s)."""

import os
import sys

from tests.nodeproc import REPO


def start_session():
    from pyspark.sql import SparkSession

    # Workers run this interpreter (it has pyarrow) and can import the checkout (research §3.5).
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("sbpnode-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        # a Python worker that starts slowly on a loaded machine (its connect-back is 15 s by
        # default: "Python worker failed to connect back" under a CI load of 30-40)
        .config("spark.python.authenticate.socketTimeout", "120s")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark
