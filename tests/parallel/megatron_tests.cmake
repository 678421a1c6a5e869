# The Megatron strategy (parallel/megatron/: tp=T, sp=S_ and the 2-D mesh tp=T,sp=S_):
# parity with the single-rank model (loss, logits, every gradient and ParamRef, weights bit for
# bit; both K/V exchanges, zigzag and contiguous, GQA and MHA, tied and untied, overlap,
# recompute, sequence parallelism, ignored targets, accumulation and loss normalizers), the
# sequence mappings' adjoint identity, the ring attention pieces, errors, and the traffic per
# layer and per step on each communicator against the written formulas (an axis of one rank
# issues nothing). Layouts by world size W: tp=W and sp=W; the 2-D meshes at W = 1, 2, 4.
# Each suite is one program, registered per layout family (case names start with the
# family) so that each entry stays well inside its timeout on a loaded machine.
foldpar_mpi_test_program(megatron_parity_test)
foldpar_mpi_test_program(megatron_traffic_test)
foreach(family tp sp)
  foldpar_mpi_test(megatron_parity_test RANKS 1 2 3 4 SUFFIX .${family} ARGS --gtest_filter=*/${family}_*)
  foldpar_mpi_test(megatron_traffic_test RANKS 1 2 3 4 SUFFIX .${family} ARGS --gtest_filter=*/${family}_*)
endforeach()
# The 2-D meshes, and everything that is not a per-family case.
foldpar_mpi_test(megatron_parity_test RANKS 1 2 3 4 SUFFIX .mesh ARGS --gtest_filter=-*/tp_*:*/sp_*)
foldpar_mpi_test(megatron_traffic_test RANKS 1 2 4 SUFFIX .mesh ARGS --gtest_filter=*/mesh_*)
# Checking mode must pass a correct schedule: on both communicators every rank issues the
# same collectives in the same order: at 3 ranks sp=3 and the tests beside the cases, as sp's
# suite held; at 4 ranks tp=2,sp=2 and the tests beside the cases, as tp x sp's suite held.
foldpar_mpi_test(megatron_parity_test RANKS 3 SUFFIX .checked ENV FOLDPAR_COMM_CHECK=1
                 ARGS --gtest_filter=-*/tp_*:*/mesh_*)
foldpar_mpi_test(megatron_parity_test RANKS 4 SUFFIX .checked ENV FOLDPAR_COMM_CHECK=1
                 ARGS --gtest_filter=-*/tp_*:*/sp_*)
