class SyncError(RuntimeError):
    """A weight version could not be received: the cause is in the message (timeout, refused
    secret, server gone, corrupt frame); nothing partial is ever returned."""
