def double(x: float) -> float:
    return 2 * x
