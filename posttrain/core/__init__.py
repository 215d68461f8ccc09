"""Pure tensor math for post-training: imports only ``torch`` (and ``posttrain.registry``).

Submodules (import the one you need; nothing is imported eagerly here, so ``import posttrain.core.kl`` stays cheap):

* ``masking`` — masked/NaN-aware reductions, completion masks from EOS
* ``logprobs`` — selective log-softmax, entropy, chunked log-probs from hidden states (no full logits)
* ``kl`` — k1/k2/k3 KL estimators
* ``advantages`` — group-normalised (GRPO), GDPO, leave-one-out (RLOO) advantages
* ``policy_objectives`` — importance weights; clip / cispo / sapo / vespo per-token objectives
* ``aggregation`` — per-token loss → scalar normalisers (grpo, bnpo, dr_grpo, dapo, luspo, …)
* ``presets`` — TRL ``loss_type`` → (objective, aggregation), configuration checks
* ``importance`` — rollout IS correction, off-policy sequence mask, entropy quantile mask
* ``preference`` — DPO/KTO/Bradley-Terry losses; ``distill`` — distillation divergences
* ``reference_free`` — CPO (SimPO, AlphaPO), TPO and ORPO losses; ``process_reward`` — PRM step-label loss
* ``averaging`` — BEMA weight averaging
"""
