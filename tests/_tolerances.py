"""The tolerances the multi-rank and training tests compare with, in one table.

Each entry says what it bounds, which tests use it, and the noise floor it was set against as the
test recorded it when it was written ("set by <test>" where no measurement was written down).
Relative errors are ``rel_err`` / ``rel_err_native`` of tests/_ref.py (a loss: ``|a - b| / |b|``)
unless the entry says otherwise. "The project's 1e-5" is the parameter bar every trajectory
test started from. Test files import the entries under their own short names
(``from _tolerances import PARITY_GRAD_RTOL as GRAD_RTOL``).

Not here: bounds written once, beside their own measurement, at a single assertion of the
one-process optimizer tests (test_preconditioners.py, test_shampoo_reference.py,
test_stacked_matrices.py), and exact (``torch.equal`` / ``== 0.0``) checks.
"""

# -- against a reference that sums the ranks' gradients in the runtime's order ------------------
# Lockstep references: one process that averages the micro-batch gradients in rank order, as the
# reduce-scatter / all-reduce does. Measured 0 (bitwise) in each user: test_sharding_trajectory
# (SOAP, Shampoo eps 1e-6, W=2/3/4, 20 steps), test_ddp_world_sizes (Muon and Shampoo, W=3, both
# modes), test_state_dict (Shampoo and AdamW, W=2 before a checkpoint and the resuming world size
# after it, one thread as each rank), test_shampoo_blocks (blocked Shampoo, bands of one matrix
# on different owners, W=2/3). 1e-6 leaves a few float32 ulps, should a backend sum in another
# order.
LOCKSTEP_RTOL = 1e-6

# Blocked Shampoo, bands of one matrix on different owners, against one process on the global
# batch (test_shampoo_blocks, float32, 4 steps): the reference against itself with the batch
# reversed differs by 4.0e-5 (W=2's batch) / 2.7e-5 (W=3's); the sharded runs by 3.6e-5 /
# 2.7e-5, the floor for banded and whole matrices alike. 5x above it.
SHAMPOO_BLOCKS_RTOL = 2e-4

# Mixed precision: bf16 gradients and fp32 master weights against a reference that sums the same
# bf16 micro-batch gradients in fp32 in the runtime's order. Measured 0.0 (W=2 and W=3, 5 steps;
# gradients, masters, bf16 compute tensors bitwise) in test_sharding_features and 0 in
# test_sharding_options; a bf16 reduction, the mutation it must reject, is ~1e-3 to 2e-3 off
# (measured and asserted per step in test_sharding_features).
MIXED_PRECISION_RTOL = 1e-6

# -- test_sharding_trajectory: 20 steps against the one-process whole-batch reference ------------
# Losses: measured worst over ranks 1.2e-7 / 1.9e-7 / 1.7e-7 (W=2/3/4); ~5x above.
TRAJECTORY_LOSS_RTOL = 1e-6
# Final parameters: measured 3.3e-6 / 4.0e-6 / 4.0e-6 (Muon, W=2/3/4), 2.4e-6 / 6.4e-6 (AdamW);
# the project's 1e-5. Also the bar of test_dtensor_params (losses and parameters of its clipped
# and torch-optimizer runs) and test_moe_split (losses and parameters), "the trajectory tests'
# bar for Muon + AdamW"; clipping adds only round-off (one factor from the same norms).
TRAJECTORY_PARAM_RTOL = 1e-5
# Shampoo (eps 1e-4) parameters at W=2: the one-process reference run twice with only the global
# batch reversed differs by 8.1e-6 after 20 steps (Muon 4.0e-6, AdamW 4.5e-6; a 2-core Xeon,
# torch 2.13 CPU), and the W=2 owner run measures 1.35e-5 (8.2e-6 on another machine); ~6x
# above that floor. Shampoo at W=3/4 is checked against its lockstep reference instead.
TRAJECTORY_SHAMPOO_PARAM_RTOL = 5e-5

# -- test_sharding_parity (and test_plan_mesh's run on the advised (2, 2) mesh) ------------------
# Worst over every scenario and rank, W=2 / HSDP W=4, vs the reference's full batch (summation
# order of the reduce-scatter and replica all-reduce); tolerances ~4x above. test_plan_mesh runs
# the same model on the same (2, 2) mesh and uses the loss, gradient and parameter entries.
PARITY_LOSS_RTOL = 1e-6  # losses 2.3e-7 / 1.4e-7 (each rank's own micro-batch loss 1.2e-7)
PARITY_GRAD_RTOL = 1e-5  # gradients 2.3e-6 / 2.2e-6
PARITY_PARAM_RTOL = 1e-5  # final parameters 2.1e-6 / 2.8e-6
PARITY_NORM_RTOL = 1e-6  # clip norms 0 / 2.8e-7
# HSDP on a (2, 3) mesh (test_sharding_parity's W=6 global-owner run, 3 steps of Muon + AdamW):
# the one-process reference run twice, the whole 12-sequence batch against the rank-order sum of
# the 6 micro-batch gradients, differs by 2.1e-4 after one step (AdamW's first step on
# layers.0.attn.proj.bias, whose gradient is round-off in places; Muon's matrices 1.4e-5 after
# three); the same measure at W=4 gives 2.6e-6. ~5x above the W=6 floor.
HSDP_W6_PARAM_RTOL = 1e-3

# -- test_sharding_features: gradients vs the single-process full batch --------------------------
FEATURES_GRAD_RTOL = 2e-6  # measured 3.4e-7 / 6.3e-7 (W=2 / W=3); ~3x above
FEATURES_NORM_RTOL = 1e-6  # norms: measured 2.3e-7 / 8.6e-8 (W=2 / W=3); ~3x above

# -- test_sharding_options: worst over ranks and scenarios, W=2 / W=3 (the test prints them) -----
OPTIONS_LOSS_RTOL = 3e-7  # losses 5.7e-8 / 7.6e-8; ~4x above
OPTIONS_GRAD_RTOL = 1e-5  # gradients 2.0e-6 / 3.6e-6; ~3x above
OPTIONS_PARAM_RTOL = 1e-5  # parameters after 3-4 steps 2.5e-6 / 6.8e-6; the project's 1e-5 (1.5x)
OPTIONS_NORM_RTOL = 2e-6  # clip norms 4.7e-7 / 2.8e-7; ~4x above
# A float16 gradient reduction against the float32 average: float16's resolution; set by
# test_sharding_options.
OPTIONS_FP16_RTOL = 1e-3

# -- test_ddp_world_sizes: DDP at W=3, 8 steps, Muon against the whole-batch reference ----------
DDP_W3_LOSS_RTOL = 5e-7  # losses: measured 1.2e-7; ~4x above
DDP_W3_PARAM_RTOL = 1e-5  # parameters: measured 2.8e-6; the project's 1e-5 (3.5x)

# -- the rest: set by the test, which records no measurement unless said ------------------------
# test_ddp: losses and parameters of both replicated modes vs a single-process reference (W=2,
# 20 steps); set by test_ddp.
DDP_RTOL = 1e-5
# test_stock_fsdp2: losses and full parameters on stock FSDP2 (W=2/3/4, HSDP at W=4, 20 steps)
# vs a single-process reference; set by test_stock_fsdp2.
STOCK_FSDP2_RTOL = 1e-5
# test_lifecycle: parameters after the lifecycle scenarios vs the reference; measured 0 or a few
# 1e-7 (summation order of the reduce-scatter vs the reference's full-batch gradient).
LIFECYCLE_RTOL = 1e-5
# test_dtensor_params: the global gradient norm (and each clipped gradient) of DTensor
# parameters vs the single-process one, every norm type; set by test_dtensor_params.
DTENSOR_NORM_RTOL = 1e-5
# test_state_dict: against the uninterrupted one-process run on the whole batch: AdamW measures
# ~1e-6. (Shampoo at eps 1e-6 amplifies the summation order alone to 3.0e-4 / 4.5e-4 in 6 steps,
# uninterrupted W=3 / W=2 runs with no checkpoint involved, so it is held to LOCKSTEP_RTOL.)
WHOLE_BATCH_RTOL = 1e-4
# test_state_dict: a DDP model resumed at W=3 vs the uninterrupted run (a fresh DDP's first
# buckets make gloo sum 3 ranks in another order); set by test_state_dict.
DDP_W3_RESUME_RTOL = 1e-4
# The real clients (test_clients_transformers, _accelerate, _torchtitan): the largest ABSOLUTE
# difference of any parameter to one process; measured ~4e-7 at W=2 and W=3 (summation orders of
# split batches), while Muon's lr 0.02 moves weights ~1e-2 a step.
CLIENT_ATOL = 1e-5
# test_module_conversion: parameters after .to(torch.float64) and 2 AdamW steps in float64 vs one
# process in float64 on the whole batch: measured 8.5e-16 (W=2) and 5.6e-15 (W=3; stock FSDP2
# 5.7e-15), the summation order of the reduce-scatter; ~20x above.
FLOAT64_PARAM_RTOL = 1e-13

# -- test_tensor_parallel: stock FSDP2 x TP on (dp=2, tp=2), 4 steps, torch.optim.Muon (bf16
# Newton-Schulz) + AdamW with clip_grad_norm_, against one process over the whole batch. The
# reference against itself with the batch's rows reversed: parameters 2.4e-8, clip norms 0,
# losses 1.0e-7 (python tests/test_tensor_parallel.py prints them); the FSDP x TP run measured
# parameters 6.5e-9 on every rank. A Newton-Schulz on TP slices instead of the whole matrix is
# off by O(lr) = 1e-2 per step.
TP_LOSS_RTOL = 1e-6
TP_NORM_RTOL = 1e-6
TP_PARAM_RTOL = 1e-6
# torchtitan's Llama3 (its config builders, init_weights: std 0.02 weights) under its own
# parallelize_llama on (dp=2, tp=2), this package's Muon with float32 Newton-Schulz + AdamW, 3
# steps with clip_grad_norm_: the one-process reference against itself with the batch's rows
# reversed moves the fused wqkv and wo by 1.7e-6 to 2.5e-6 (Newton-Schulz of these small, badly
# conditioned first gradients amplifies the round-off; the norms agree exactly, the losses to
# 1.2e-7); the (2, 2) run measured 1.9e-6 (wqkv), clip norms within TP_NORM_RTOL. 4x the floor:
TITAN_PARAM_RTOL = 1e-5
# The same bound for the checkpoint runs (tests/_titan_checkpoint.py: separate q/k/v, resumed at
# step 1 on the 1D layouts, back on (2, 2) at step 2): the reference against itself with the rows
# reversed 2.3e-6; measured (2, 2) 1.7e-6, owner layout W=2 1.5e-6, W=4 1.5e-6, stock FSDP2 W=4
# 1.5e-6, back on (2, 2) 1.6e-6.
# torchtitan's Qwen3-MoE (float32 experts, separate q/k/v: tests/_titan.py) under
# parallelize_qwen3 with expert_parallel_degree=2 on 4 ranks, this package's Muon (float32
# Newton-Schulz) + AdamW, 3 steps: the one-process reference against itself with the batch's rows
# reversed 9.3e-7 (Newton-Schulz amplifying round-off); the EP run measured 1.4e-6 on every rank
# (and bitwise one process fed the same gradients). With torchtitan's bfloat16 expert matmuls the
# expert gradients alone differ by 2e-3 (each ep rank's partial rounded to bfloat16), hence the
# float32 experts. 5x the floor:
MOE_PARAM_RTOL = 5e-6

# HSDP (2, 2), float16 compute (MixedPrecisionPolicy) + GradScaler, one step skipped for an
# infinity in one replica's matrix gradient, against float32 in one process after 3 steps:
# measured 2.9e-3 (float16 round-off of the forward and the gradients); ~3.4x above.
HSDP_FP16_PARAM_RTOL = 1e-2

# Pipeline stages on the owner layout (tests/test_pipeline_stages.py, (pp=2, dp=2), 3 steps):
# the one-process reference (gradients accumulated over the pipeline's micro-batches) against
# itself with each micro-batch's rows reversed differs by 8.0e-8 (parameters) and 8.3e-8
# (losses) on an AVX2 CPU; the stages measured 9.4e-8 against it. ~5x the floor:
PP_PARAM_RTOL = 4e-7
PP_LOSS_RTOL = 4e-7
