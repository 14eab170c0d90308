"""The gated fill's bitmask buffers: two in turn, grown by doubling (a served batch grows a
request at a time; each growth is a pinned allocation on the engine thread)."""
from tandem.structured_output.buffers import BitmaskBuffers


def test_two_buffers_in_turn_each_grown_by_doubling():
    bufs = BitmaskBuffers(words=3, pinned=False)
    a, b = bufs.next(10), bufs.next(10)
    assert a.shape == b.shape == (10, 3)
    assert a.data_ptr() != b.data_ptr()  # the next step's fill never writes the buffer being read
    assert bufs.next(5).data_ptr() == a.data_ptr()  # smaller: the same storage, sliced
    assert bufs.next(64).data_ptr() == b.data_ptr()  # 64 rows fit in the first allocation
    storages = set()
    for rows in range(65, 300):  # a batch growing by one request a step
        buf = bufs.next(rows)
        assert buf.shape == (rows, 3)
        storages.add((buf.data_ptr(), buf.untyped_storage().nbytes() // (3 * 4)))
    # Each buffer reallocated only where it doubles (128, 256, 512 rows), not at every row.
    assert sorted(rows for _, rows in storages) == [128, 128, 256, 256, 512, 512]
