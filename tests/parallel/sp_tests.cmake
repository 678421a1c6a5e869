# SP (sequence parallelism with replicated weights, parallel/sp/): parity with the
# single-rank model for both K/V exchanges and the ring attention pieces, and the traffic
# formulas per layer and per step.
foldpar_mpi_test_program(sp_parity_test)
foldpar_mpi_test(sp_parity_test RANKS 1 2 3 4)
foldpar_mpi_test_program(sp_traffic_test)
foldpar_mpi_test(sp_traffic_test RANKS 1 2 3 4)
# Checking mode must pass a correct schedule: every rank issues the same collectives in order.
foldpar_mpi_test(sp_parity_test RANKS 3 SUFFIX .checked ENV FOLDPAR_COMM_CHECK=1)
