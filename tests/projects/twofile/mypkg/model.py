def describe(rank: int, world: int, total: float) -> str:
    return f"rank {rank}/{world} sum {total:g}"
