"""kernel/order.py: requests take their turns in the kernel's numbering, whatever thread has them."""
import threading
import time

from ckptfs.fuse.kernel.order import KernelOrder


def test_turns_follow_the_request_numbers_not_the_threads():
    order = KernelOrder(gap_s=5)
    order.start(2)  # the INIT was number 2: requests follow from 4, in steps of 2
    went = []

    def serve(unique):
        order.turn(unique)
        went.append(unique)
        order.done(unique)
    threads = [threading.Thread(target=serve, args=(u,)) for u in (12, 10, 8, 6, 4)]
    for t in threads:
        t.start()
        time.sleep(0.01)  # the later numbers arrive first
    for t in threads:
        t.join(10)
    assert went == [4, 6, 8, 10, 12] and order.gaps == 0


def test_a_number_that_never_comes_is_given_up_on_and_interrupts_never_wait():
    order = KernelOrder(gap_s=0.02)
    order.start(2)
    t0 = time.monotonic()
    order.turn(8)  # 4 and 6 never come (interrupted before they were read)
    assert 0.015 < time.monotonic() - t0 < 2 and order.gaps == 1
    order.done(8)
    order.turn(6)  # a late one does not wait either
    order.turn(11)  # an INTERRUPT's number (bit 0): no turn
    order.done(4)
    order.turn(10)  # 10 is next: no wait
    assert order.gaps == 1


def test_done_ahead_of_turn_is_remembered():
    order = KernelOrder(gap_s=5)
    order.start(2)
    order.done(6)
    order.done(4)
    t0 = time.monotonic()
    order.turn(8)
    assert time.monotonic() - t0 < 1
