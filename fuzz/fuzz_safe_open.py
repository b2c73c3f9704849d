"""Fuzz target: ``safe_open`` with both backends (numpy) and every accessor.

Each input is written to a scratch file (in RAM where possible) and opened with ``mmap`` and
``pread``; keys, metadata, get_tensor, get_tensors and get_slice with indices derived from the
input are checked against the file's own bytes and against numpy indexing.
"""

import _driver

if __name__ == "__main__":
    _driver.main(_driver._harness.check_file, structured=True)
