"""Fuzz target: length prefix + header parsing (``_format``, rules R1-R8) on raw bytes."""

import _driver

if __name__ == "__main__":
    _driver.main(_driver._harness.check_header, structured=True)
