"""The executor's cost counters (what an Apple GPU pays beyond bytes): for
each, a kernel that is bad on purpose and one that is good
(kernels/counters.metal), with the expected values worked out by hand from
the access pattern."""

from pathlib import Path

import numpy as np
import pytest
import torch

import mps_ext_executor as cpu_metal

SOURCE = Path(__file__).parent / "kernels" / "counters.metal"
ROOT = Path(__file__).resolve().parents[2]

# 128 threads in threadgroups of 64: two threadgroups of two simdgroups.
THREADS, GROUP = 128, 64
SIMDGROUPS = THREADS // 32


@pytest.fixture
def lib(kernels):
    return kernels("counters")


def run(lib, name, args, threads=THREADS, **kwargs):
    return lib.dispatch(name, args, threads=threads, threads_per_threadgroup=GROUP, counters=True, **kwargs)


def line_of(marker: str) -> int:
    lines = SOURCE.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if marker in line)


# ------------------------------------------------------------- coalescing --
def test_contiguous_access_is_one_line_per_simdgroup_instruction(lib):
    x = torch.randn(THREADS)
    out = torch.zeros(THREADS)
    s = run(lib, "copy_contiguous", [out, x])
    assert torch.equal(out, x)
    # Each simdgroup reads and writes 32 x 4 = 128 aligned bytes: one line.
    assert s.cache_lines == {0: SIMDGROUPS, 1: SIMDGROUPS}
    assert s.cache_lines_minimum == {0: SIMDGROUPS, 1: SIMDGROUPS}
    assert s.coalescing == {0: 1.0, 1: 1.0}


def test_strided_access_touches_a_line_per_lane(lib):
    x = torch.randn(THREADS * 32)
    out = torch.zeros(THREADS)
    s = run(lib, "copy_strided", [out, x])
    assert torch.equal(out, x[::32])
    # Lanes 128 bytes apart: 32 lines where the 128 bytes would fit in one.
    assert s.cache_lines[1] == 32 * SIMDGROUPS
    assert s.cache_lines_minimum[1] == SIMDGROUPS
    assert s.coalescing[1] == 32.0
    assert s.coalescing[0] == 1.0  # the writes are contiguous


def test_lines_are_counted_from_the_start_of_the_storage(lib):
    # A GPU buffer starts page-aligned; a view 64 bytes into it puts each
    # simdgroup's 128 bytes across two lines, one 128 bytes in does not.
    storage = torch.randn(THREADS + 32)
    out = torch.zeros(THREADS)
    s = run(lib, "copy_contiguous", [out, storage[16:]])
    assert s.cache_lines[1] == 2 * SIMDGROUPS and s.cache_lines_minimum[1] == SIMDGROUPS
    assert s.coalescing[1] == 2.0
    s = run(lib, "copy_contiguous", [out, storage[32:]])
    assert s.coalescing[1] == 1.0


def test_sixteen_byte_access_takes_four_lines_and_needs_four(lib):
    x = torch.randn(THREADS * 4)
    out = torch.zeros(THREADS * 4)
    s = run(lib, "copy_float4", [out, x])
    assert s.cache_lines == {0: 4 * SIMDGROUPS, 1: 4 * SIMDGROUPS}
    assert s.coalescing == {0: 1.0, 1: 1.0}


def test_a_simdgroup_matrix_load_is_one_eight_byte_access_a_lane(lib):
    x = torch.randn(SIMDGROUPS * 64)
    out = torch.zeros(SIMDGROUPS * 64)
    s = run(lib, "copy_matrix", [out, x])
    assert torch.equal(out, x)
    # Each simdgroup moves 256 contiguous aligned bytes: two lines, all used.
    assert s.cache_lines == {0: 2 * SIMDGROUPS, 1: 2 * SIMDGROUPS}
    assert s.coalescing == {0: 1.0, 1: 1.0}


def test_a_broadcast_read_is_one_line(lib):
    out = torch.zeros(THREADS)
    s = run(lib, "broadcast", [out, torch.tensor([3.0])])
    assert (out == 3.0).all()
    assert s.cache_lines[1] == SIMDGROUPS and s.cache_lines_minimum[1] == SIMDGROUPS


def test_lanes_are_matched_in_the_same_iteration_of_a_loop_around_a_simd_operation(lib):
    # Lane i stores in iteration i: four instructions of one lane each, not
    # one instruction of four lanes 128 bytes apart.
    out = torch.zeros(8 * 32)  # 2 simdgroups x 4 iterations, a line each
    s = lib.dispatch("write_in_turn", [out], threadgroups=1, threads_per_threadgroup=64, counters=True)
    assert out[::32][:8].tolist() == [sum(range(32))] * 8
    assert s.cache_lines[0] == 2 * 4 and s.cache_lines_minimum[0] == 2 * 4
    assert s.coalescing[0] == 1.0


def test_counters_off_by_default_and_on_in_a_record_block(lib):
    x, out = torch.randn(THREADS), torch.zeros(THREADS)
    s = lib.dispatch("copy_contiguous", [out, x], threads=THREADS, threads_per_threadgroup=GROUP)
    assert not s.counters and s.cache_lines == {} and s.bank_conflict_cycles == 0
    with pytest.raises(ValueError, match="not measured.*counters=True"):
        s.coalescing
    with cpu_metal.record(counters=True) as rec:
        lib.dispatch("copy_contiguous", [out, x], threads=THREADS, threads_per_threadgroup=GROUP)
    (d,) = rec.dispatches
    assert d.counters and d.coalescing == {0: 1.0, 1: 1.0}
    with cpu_metal.record() as rec:
        lib.dispatch("copy_contiguous", [out, x], threads=THREADS, threads_per_threadgroup=GROUP)
    assert not rec.dispatches[0].counters


# -------------------------------------------------- 64-bit integer work --
def int_params(divisor=7, factor=5):
    dtype = np.dtype([("divisor", "<u8"), ("factor", "<u8"), ("divisor32", "<u4"), ("pad", "<u4")])
    return np.array([(divisor, factor, divisor, 0)], dtype=dtype)[0]


def test_64_bit_division_and_remainder_are_counted(lib):
    x = torch.randint(0, 2**40, (2 * THREADS,), dtype=torch.int64)
    out = torch.zeros(2 * THREADS, dtype=torch.int64)
    s = run(lib, "div_mod_64", [out, x, int_params(7)])
    assert torch.equal(out[0::2], x[0::2] // 7) and torch.equal(out[1::2], x[1::2] % 7)
    # One division and one remainder by a run-time value per thread.
    assert s.int64_divisions == 2 * THREADS
    assert s.int64_divisions_per_thread == 2.0 and s.max_int64_divisions_per_thread == 2
    assert s.int64_multiplications == 0


def test_32_bit_division_and_index_arithmetic_are_not_64_bit_work(lib):
    x = torch.randint(0, 2**30, (2 * THREADS,), dtype=torch.int32)
    out = torch.zeros(2 * THREADS, dtype=torch.int32)
    s = run(lib, "div_mod_32", [out, x, int_params(7)])
    assert torch.equal(out[0::2], x[0::2] // 7) and torch.equal(out[1::2], x[1::2] % 7)
    assert s.int64_divisions == 0 and s.int64_multiplications == 0


def test_64_bit_multiplications_and_divisions_by_constants(lib):
    x = torch.randint(0, 2**40, (4 * THREADS,), dtype=torch.int64)
    out = torch.zeros(4 * THREADS, dtype=torch.int64)
    s = run(lib, "mul_64", [out, x, int_params(factor=5)])
    assert torch.equal(out[0::4], x[0::4] * 5) and torch.equal(out[1::4], x[1::4] * 8)
    assert torch.equal(out[2::4], x[2::4] // 8) and torch.equal(out[3::4], x[3::4] // 7)
    # a * factor, and d / 7 (a multiplication by the reciprocal); * 8 and / 8
    # are shifts.
    assert s.int64_multiplications == 2 * THREADS
    assert s.int64_divisions == 0


def test_a_vector_multiplication_counts_each_element(lib):
    x = torch.randint(0, 2**20, (4 * THREADS,), dtype=torch.int64)
    out = torch.zeros(2 * THREADS, dtype=torch.int64)
    s = run(lib, "mul_64_vector", [out, x])
    pairs = x.view(THREADS, 2, 2)
    assert torch.equal(out.view(THREADS, 2), pairs[:, 0] * pairs[:, 1])
    assert s.int64_multiplications == 2 * THREADS


def test_the_busiest_thread_and_the_total(lib):
    x = torch.arange(THREADS, dtype=torch.int64) * 100
    out = torch.zeros(THREADS, dtype=torch.int64)
    s = run(lib, "div_some", [out, x, int_params(7)])
    assert s.int64_divisions == 3 and s.max_int64_divisions_per_thread == 1


# -------------------------------------------------------------- registers --
def test_a_kernel_holding_64_floats_needs_64_registers(lib):
    info = lib.kernel_info("hold_64_floats")
    # 64 loaded floats are all live before the first product; beyond them
    # only the index, an address and the sum.
    assert 64 <= info.registers <= 64 + 12
    assert info.registers > cpu_metal.FULL_OCCUPANCY_REGISTERS
    assert info.private_bytes == 0  # indexed by constants once unrolled: registers


def test_occupancy_follows_mesas_table():
    # Mesa's AGX compiler (src/asahi/compiler/agx_performance.c): up to 104
    # 16-bit registers 1024 threads, 112: 896, ..., 256: 384.
    assert cpu_metal.occupancy(cpu_metal.FULL_OCCUPANCY_REGISTERS) == 1024
    assert [cpu_metal.occupancy(r) for r in (1, 52, 53, 56, 57, 92, 104, 128)] == [1024, 1024, 896, 896, 832, 576,
                                                                                  512, 384]
    assert cpu_metal.occupancy(cpu_metal.MAX_REGISTERS + 1) == 0  # spills
    assert [cpu_metal.registers_for(t) for t in (1024, 1000, 896, 512, 384, 32)] == [52, 52, 56, 104, 128, 128]
    with pytest.raises(ValueError, match="threads must be in 1..1024"):
        cpu_metal.registers_for(2048)


def test_halves_take_half_a_register(lib):
    assert 32 <= lib.kernel_info("hold_64_halves").registers <= 32 + 12


def test_a_streaming_kernel_needs_few_registers(lib):
    info = lib.kernel_info("scale")
    assert info.registers <= 8
    assert info.registers <= cpu_metal.FULL_OCCUPANCY_REGISTERS


def test_parameters_from_a_constant_buffer_are_uniform_registers(lib):
    info = lib.kernel_info("uniform_params")
    assert info.uniform_registers >= 16 * 2  # sixteen ulongs
    assert info.registers <= 12


def test_the_stats_carry_the_kernel_info(lib):
    x, out = torch.randn(THREADS * 64), torch.zeros(THREADS)
    s = lib.dispatch("hold_64_floats", [out, x], threads=THREADS, threads_per_threadgroup=GROUP)
    assert s.kernel_info == lib.kernel_info("hold_64_floats")
    v = x.view(THREADS, 64).double()
    torch.testing.assert_close(out.double(), (v * v.flip(1)).sum(1), rtol=1e-5, atol=1e-4)


# --------------------------------------------------------- private memory --
def test_a_dynamically_indexed_private_array_stays_in_memory(lib):
    assert lib.kernel_info("private_dynamic").private_bytes == 16 * 4


def test_a_constantly_indexed_private_array_is_registers(lib):
    assert lib.kernel_info("private_constant").private_bytes == 0


def test_values_handed_to_simd_operations_are_not_private_memory(lib):
    assert lib.kernel_info("simd_reduce").private_bytes == 0


# ----------------------------------------------------------- bank conflicts --
# 64 threads store and then load threadgroup memory: 2 simdgroups x 2
# instructions.
@pytest.mark.parametrize("stride,extra", [
    (1, 0),    # consecutive words: one per bank
    (2, 1),    # two words in every other bank: 2-way, 1 extra cycle
    (32, 31),  # all 32 words in bank 0: 31 extra cycles
    (33, 0),   # padded: one per bank again
])
def test_bank_conflicts_of_a_strided_threadgroup_access(lib, stride, extra):
    out = torch.zeros(64)
    s = run(lib, "threadgroup_stride", [out, np.uint32(stride)], threads=64)
    assert torch.equal(out, torch.arange(64.0))
    assert s.threadgroup_memory_instructions == 4
    assert s.bank_conflict_cycles == 4 * extra


def test_a_broadcast_from_threadgroup_memory_is_free(lib):
    out = torch.zeros(64)
    s = run(lib, "threadgroup_broadcast", [out], threads=64)
    assert (out == 0).all()
    assert s.threadgroup_memory_instructions == 4 and s.bank_conflict_cycles == 0


def test_sixteen_bytes_a_thread_is_not_a_conflict(lib):
    out = torch.zeros(64 * 4)
    s = run(lib, "threadgroup_float4", [out], threads=64)
    assert torch.equal(out.view(64, 4)[:, 0], torch.arange(63.0, -1, -1))
    assert s.bank_conflict_cycles == 0


# --------------------------------------------------------- loads in flight --
def test_pointer_chasing_has_one_load_in_flight(lib):
    info = lib.kernel_info("chase")
    assert info.loads_in_flight == 1
    assert info.hot_loop == f"counters.metal:{line_of('k < steps')}:3"


def test_independent_streams_are_all_in_flight(lib):
    assert lib.kernel_info("four_streams").loads_in_flight == 4  # the constant `n` is not device memory


def test_a_sixteen_byte_load_is_one_load(lib):
    assert lib.kernel_info("one_float4_stream").loads_in_flight == 1


def test_the_hot_loop_is_the_one_with_the_most_loads(lib):
    info = lib.kernel_info("two_loops")
    assert info.loads_in_flight == 3
    assert info.hot_loop == f"counters.metal:{line_of('the hot loop')}:3"


def test_a_kernel_without_a_loop_counts_as_one_iteration(lib):
    info = lib.kernel_info("copy_contiguous")
    assert info.loads_in_flight == 1 and info.hot_loop == ""


# --------------------------------------------------------- buffer names --
def test_buffer_names_of_a_python_dispatch(lib):
    s = run(lib, "div_mod_64", [torch.zeros(2 * THREADS, dtype=torch.int64),
                                torch.ones(2 * THREADS, dtype=torch.int64), int_params()])
    assert s.buffer_names == {0: "out", 1: "in", 2: "p"}
    assert s.buffer("in") == 1


def test_dispatches_of_the_op_layer_carry_names_info_and_counters():
    from tools.embed_shaders import source

    x = torch.randn(4, 64)
    with cpu_metal.record(counters=True) as rec:
        out = torch.ops.mps_ext.constant_pad_nd(x, [1, 1], 0.0)
    (d,) = rec.dispatches
    pad = cpu_metal.compile_library(source("pad"), filename="pad.metal")
    names = {p["index"]: p["name"] for p in pad.parameters(d.kernel) if p["kind"] == "buffer"}
    assert d.buffer_names == names
    assert d.kernel_info == pad.kernel_info(d.kernel)
    assert d.counters
    # Every output byte is written once, so the instructions that write it
    # need at least its size in lines.
    o = next(i for i, n in names.items() if d.bytes_written.get(i))
    assert d.bytes_written[o] == out.nbytes
    assert d.cache_lines_minimum[o] >= out.nbytes / 128
    assert d.coalescing[o] >= 1.0


# ---------------------------------------------- re-reads by threadgroups --
def test_an_operand_every_threadgroup_reads_counts_once_per_threadgroup(lib):
    x, out = torch.randn(GROUP), torch.zeros(THREADS)
    s = run(lib, "every_group_reads_all", [out, x])
    assert torch.equal(out, (x + x).repeat(THREADS // GROUP))
    groups = THREADS // GROUP
    # Each of the two threadgroups reads all 256 bytes of x, every byte
    # twice: bytes_read counts 4 x 256, each threadgroup's distinct bytes
    # 256, the dispatch's 256.
    assert s.bytes_read[1] == 2 * groups * x.nbytes
    assert s.threadgroup_bytes_read_distinct[1] == groups * x.nbytes
    assert s.unique_bytes_read[1] == x.nbytes
    assert s.reread_factor[1] == groups


def test_a_kernel_whose_threadgroups_read_their_own_bytes_rereads_nothing(lib):
    x, out = torch.randn(THREADS), torch.zeros(THREADS)
    s = run(lib, "copy_contiguous", [out, x])
    assert s.threadgroup_bytes_read_distinct[1] == s.unique_bytes_read[1] == x.nbytes
    assert s.reread_factor == {1: 1.0}


def test_rereads_are_measured_with_the_counters_only(lib):
    x, out = torch.randn(GROUP), torch.zeros(THREADS)
    s = lib.dispatch("every_group_reads_all", [out, x], threads=THREADS, threads_per_threadgroup=GROUP)
    assert s.unique_bytes_read == {}
    with pytest.raises(ValueError, match="not measured"):
        s.reread_factor


# --------------------------------------------------- threadgroup memory --
def test_threadgroup_memory_limits_the_threadgroups_a_core_keeps(lib):
    out = torch.zeros(64)
    s = lib.dispatch("threadgroup_24k", [out], threadgroups=1, threads_per_threadgroup=64)
    assert torch.equal(out, torch.arange(64.0) * 64)
    assert s.threadgroup_memory == 24 * 1024
    # 64 KiB a core holds two 24 KiB threadgroups (registers would allow 16
    # of 64 threads).
    assert s.threadgroups_per_core == 2


def test_a_small_threadgroup_memory_leaves_the_registers_to_decide(lib):
    out = torch.zeros(64)
    s = lib.dispatch("threadgroup_broadcast", [out], threadgroups=1, threads_per_threadgroup=64)
    assert s.threadgroup_memory == 64 * 4
    assert s.threadgroups_per_core == cpu_metal.occupancy(s.kernel_info.registers) // 64 == 16


def test_threadgroup_buffers_of_the_dispatch_count(lib):
    out = torch.zeros(64)
    s = lib.dispatch("threadgroup_dynamic", [out], threadgroups=1, threads_per_threadgroup=64,
                     threadgroup_memory=[20 * 1024])
    assert torch.equal(out, torch.arange(63.0, -1, -1) + 1)
    assert s.threadgroup_memory == 20 * 1024 + 64 * 4
    assert s.threadgroups_per_core == 3


def test_threadgroups_per_core_rule():
    f = cpu_metal.threadgroups_per_core
    assert cpu_metal.THREADGROUP_MEMORY_PER_CORE == 64 * 1024 and cpu_metal.MAX_THREADGROUP_MEMORY == 32 * 1024
    assert [f(m, 128) for m in (0, 8 * 1024, 12 * 1024, 18 * 1024, 31 * 1024, 32 * 1024)] == [8, 8, 5, 3, 2, 2]
    assert f(0, 128, registers=128) == 384 // 128
    assert f(33 * 1024, 64) == 0
    with pytest.raises(ValueError, match="threads must be positive"):
        f(0, 0)


# ------------------------------------------------------------- divisions --
def test_32_bit_division_by_a_run_time_value_is_counted(lib):
    x = torch.randint(0, 2**30, (2 * THREADS,), dtype=torch.int32)
    out = torch.zeros(2 * THREADS, dtype=torch.int32)
    s = run(lib, "div_mod_32", [out, x, int_params(7)])
    assert s.int32_divisions == 2 * THREADS and s.max_int32_divisions_per_thread == 2
    assert s.int32_divisions_per_thread == 2.0
    assert s.float_divisions == 0


def test_32_bit_division_by_a_constant_is_not(lib):
    x = torch.randint(0, 2**30, (2 * THREADS,), dtype=torch.int32)
    out = torch.zeros(2 * THREADS, dtype=torch.int32)
    s = run(lib, "div_mod_32_constant", [out, x])
    assert torch.equal(out[0::2], x[0::2] // 7) and torch.equal(out[1::2], x[1::2] % 16)
    assert s.int32_divisions == 0


def test_ieee_float_divisions_are_counted(lib):
    a, b = torch.randn(THREADS), torch.rand(THREADS) + 0.5
    out = torch.zeros(THREADS)
    s = run(lib, "divide_floats", [out, a, b])
    want = a / b + (a.half() / b.half()).float()
    torch.testing.assert_close(out, want, rtol=1e-3, atol=1e-3)
    # One float and one half division per thread.
    assert s.float_divisions == 2 * THREADS and s.max_float_divisions_per_thread == 2
    assert s.int32_divisions == 0


def test_a_division_by_a_power_of_two_and_fast_divide_are_not(lib):
    a, b = torch.randn(THREADS), torch.rand(THREADS) + 0.5
    out = torch.zeros(THREADS)
    s = run(lib, "divide_cheaply", [out, a, b])
    torch.testing.assert_close(out, a / 4 + a / b)
    assert s.float_divisions == 0


# ------------------------------------------------ registers: CPU artefacts --
def test_per_thread_addresses_and_predicates_take_no_64_bit_registers(lib):
    # Eight per-thread addresses and eight comparisons live across the loop:
    # on a GPU eight 32-bit offsets, the comparisons in the selects, the sum,
    # the counter and the values of a step; counted as 64-bit pointers (2
    # each) and bools (half each), they were 26.
    info = lib.kernel_info("eight_pointers")
    assert info.registers <= 8 + 10
    n = 4
    at = torch.randint(0, 1000, (THREADS * 8,), dtype=torch.int32)
    x, out = torch.randn(1000 + n), torch.zeros(THREADS)
    lib.dispatch("eight_pointers", [out, x, at, np.uint32(n)], threads=THREADS, threads_per_threadgroup=GROUP)
    idx = at.long().view(THREADS, 8)
    picked = torch.where((idx % 2 == 1)[..., None], x[idx[..., None] + torch.arange(n)],
                         torch.tensor([2.0, 3, 5, 7, 11, 13, 17, 19])[None, :, None])
    torch.testing.assert_close(out, picked.sum((1, 2)))


# ------------------------------------------------ loads after a barrier --
def reference_steps(a, n):
    acc = torch.zeros(64, dtype=torch.float64)
    for t in range(n):
        pub = acc[t % 64].clone()
        acc += a[t * 64:(t + 1) * 64].double() * pub
    return acc


@pytest.mark.parametrize("name,after", [("load_after_barrier", 1), ("load_before_barrier", 0)])
def test_a_load_used_after_a_barrier_waits_behind_it(lib, name, after):
    info = lib.kernel_info(name)
    assert info.loads_after_barrier == after
    n = 5
    a, out = torch.rand(64 * n) + 0.5, torch.zeros(64)
    lib.dispatch(name, [out, a, np.uint32(n)], threadgroups=1, threads_per_threadgroup=64)
    torch.testing.assert_close(out.double(), reference_steps(a, n))


def test_a_kernel_without_a_barrier_has_no_load_after_one(lib):
    assert lib.kernel_info("four_streams").loads_after_barrier == 0


# ------------------------------------------------------- compute counters --
# kernels/counters.metal matrix_counts: per simdgroup, one matrix load from
# device and one from threadgroup memory, `steps` half MMAs and one float
# one, one store to threadgroup and one to device memory.
@pytest.mark.parametrize("groups,steps", [(1, 0), (3, 5)])
def test_simdgroup_matrix_operations_are_counted_by_kind_and_memory(lib, groups, steps):
    a = torch.randn(64).half()
    out = torch.zeros(groups * 2 * 64)
    s = lib.dispatch("matrix_counts", [out, a, np.uint32(steps)], threadgroups=groups, threads_per_threadgroup=64)
    simdgroups = 2 * groups
    assert s.simdgroup_mmas == simdgroups * (steps + 1)
    assert s.simdgroup_mmas_32 == simdgroups
    assert (s.matrix_loads_device, s.matrix_loads_threadgroup) == (simdgroups, simdgroups)
    assert (s.matrix_stores_device, s.matrix_stores_threadgroup) == (simdgroups, simdgroups)
    # Threadgroup memory per threadgroup: 64 halves staged (written once,
    # read by each simdgroup's load), and each simdgroup's 64 floats stored.
    assert s.threadgroup_bytes_written == groups * (64 * 2 + 2 * 64 * 4)
    assert s.threadgroup_bytes_read == groups * 2 * 64 * 2
    assert s.matrix_flops == 2 * 512 * simdgroups * (steps + 1)
    assert s.flops_per_threadgroup_byte == s.matrix_flops / (s.threadgroup_bytes_read + s.threadgroup_bytes_written)
    # Device: 128 bytes of `a` read by the staging and 128 by each
    # simdgroup's load, 256 bytes of `out` written by each simdgroup.
    assert s.memory_bytes_moved == groups * (128 + 2 * 128 + 2 * 256)
    assert s.flops_per_device_byte == s.matrix_flops / s.memory_bytes_moved


def test_matrix_issue_slots_follow_the_model(lib):
    a = torch.randn(64).half()
    s = lib.dispatch("matrix_counts", [torch.zeros(128), a, np.uint32(4)], threadgroups=1,
                     threads_per_threadgroup=64)
    # 2 simdgroups x (4 half MMAs + 1 float one), 4 loads and stores each.
    assert s.matrix_issue_slots == 2 * (4 * cpu_metal.MMA_ISSUE_SLOTS + cpu_metal.MMA_ISSUE_SLOTS_32)
    assert s.issue_slots == s.instructions / 32 + s.matrix_issue_slots + 2 * 4 * cpu_metal.MATRIX_MEMORY_ISSUE_SLOTS
    assert 0 < s.matrix_slot_fraction < 1
    assert s.matrix_slot_fraction == s.matrix_issue_slots / s.issue_slots


def test_instructions_grow_by_the_same_count_each_loop_step(lib):
    x = torch.randn(64)

    def instructions(n):
        s = lib.dispatch("instruction_loop", [torch.zeros(64), x, np.uint32(n)], threads=64,
                         threads_per_threadgroup=64)
        assert s.max_instructions_per_thread * 64 == s.instructions  # every thread runs the same code
        return s.max_instructions_per_thread

    i8, i16, i24 = instructions(8), instructions(16), instructions(24)
    step = (i16 - i8) / 8
    assert step >= 3 and step == int(step)  # a load, a multiply-add, the counter and the branch: a few, whole
    assert i24 - i16 == i16 - i8
    assert i8 > 8 * step  # and the code around the loop


def test_the_executors_own_matrix_code_is_not_counted_as_instructions(lib):
    # A multiply-accumulate is hundreds of instructions of the executor's
    # stand-in (mx_metal.h); counted as the engine's MMAs, not as the
    # shader's instructions: a step of the loop around it is a few (the
    # counter, compare and branch, and the reloads of the operands from the
    # memory the executor keeps matrices in: 7 in all, per lane, so under a
    # quarter of a simdgroup's slot beside the MMA's 17).
    a = torch.randn(64).half()

    def instructions(steps):
        return lib.dispatch("matrix_counts", [torch.zeros(128), a, np.uint32(steps)], threadgroups=1,
                            threads_per_threadgroup=64).max_instructions_per_thread

    per_step = (instructions(20) - instructions(10)) / 10
    assert 1 <= per_step <= 8
