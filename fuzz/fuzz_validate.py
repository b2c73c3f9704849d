"""Fuzz target: ``validate`` against the reader's verdict on the same bytes."""

import _driver

if __name__ == "__main__":
    _driver.main(_driver._harness.check_validate, structured=True)
