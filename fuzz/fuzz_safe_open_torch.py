"""Fuzz target: ``safe_open(framework="pt")`` next to numpy: same acceptance, right shapes."""

import _driver


def check(data: bytes) -> None:
    _driver._harness.check_file(data, frameworks=("np", "pt"))


if __name__ == "__main__":
    import torch  # noqa: F401 - imported before instrumentation starts mattering

    _driver.main(check, structured=True)
