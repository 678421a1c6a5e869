# Megatron tensor parallelism (parallel/tp/): parity with the single-rank model (loss, logits,
# every gradient; plain and sequence-parallel, GQA and MHA, tied and untied, recompute), the
# mappings' adjoint identity, errors, and the traffic per layer against docs/tsp.md section 7.
foldpar_mpi_test_program(tp_parity_test)
foldpar_mpi_test(tp_parity_test RANKS 1 2 3 4)
foldpar_mpi_test_program(tp_traffic_test)
foldpar_mpi_test(tp_traffic_test RANKS 1 2 3 4)
