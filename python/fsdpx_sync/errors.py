class SyncError(RuntimeError):
    """A weight version could not be received: the cause is in the message (timeout, refused
    secret, server gone, corrupt frame); nothing partial is ever returned."""


class FetchLate(SyncError):
    """A fetch's deadline passed while the tensors of the version it received were checked: nothing
    was applied."""


# Loops over a version's tensors look at the fetch's deadline once every LATE_EVERY of them (a clock
# read costs what checking a small tensor does): ``n & LATE_MASK == LATE_MASK``.
LATE_EVERY = 256
LATE_MASK = LATE_EVERY - 1


def late(where: str, done: int, total: int) -> FetchLate:
    """The error of a loop that found the fetch's deadline passed after ``done`` of ``total`` items."""
    return FetchLate(f"fsdpx: {where}: the fetch's timeout ended while its tensors were checked ({done} of {total}): "
                     "nothing was applied (the timeout covers receiving and checking the version: pass a longer one)")
