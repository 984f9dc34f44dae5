//! Losses and per-example scores over the kept (labelled) positions of a batch.
use tch::{Kind, Tensor};

/// Mean next-token NLL over kept positions: `logits` `[N, V]`, `targets` `[N]`.
pub fn nll(logits: &Tensor, targets: &Tensor) -> Tensor {
    logits.to_kind(Kind::Float).cross_entropy_for_logits(targets)
}

/// [`nll`]'s value and its gradient w.r.t. `logits`, `(softmax − onehot(targets)) / N`,
/// computed directly (no graph): for callers that backpropagate through the LM head by hand.
pub fn nll_and_grad(logits: &Tensor, targets: &Tensor) -> (f64, Tensor) {
    let logp = logits.to_kind(Kind::Float).log_softmax(-1, Kind::Float);
    let n = targets.size()[0].max(1) as f64;
    let idx = targets.unsqueeze(1);
    let nll = -logp.gather(1, &idx, false).sum(Kind::Float).double_value(&[]) / n;
    let onehot = logp.zeros_like().scatter_value(1, &idx, 1.0);
    (nll, (logp.exp() - onehot) / n)
}

/// The edit loss of a batch of edit examples, `Σ_rows mean NLL of the row's positions`, and
/// its gradient w.r.t. `logits`, `(softmax − onehot(targets)) / n_row` at each position (no
/// graph). `rows` `[N]` names each position's batch row.
///
/// Each example's gradient is exactly the one it has when edited alone (a mean over all
/// positions of the batch would shrink it by the batch's token count): the editor, trained
/// on one example at a time, sees every example of a batch as it saw its training examples,
/// and a batch edit is the sum of the examples' own edits (MEND's batched setting). With one
/// example this is [`nll_and_grad`]. The value returned is the mean over the rows.
pub fn nll_and_grad_per_row(logits: &Tensor, targets: &Tensor, rows: &Tensor, batch: i64) -> (f64, Tensor) {
    let logp = logits.to_kind(Kind::Float).log_softmax(-1, Kind::Float);
    let idx = targets.unsqueeze(1);
    let counts = Tensor::zeros([batch], (Kind::Float, logits.device())).index_add(0, rows, &Tensor::ones([rows.size()[0]], (Kind::Float, logits.device())));
    let w = counts.clamp_min(1.0).reciprocal().index_select(0, rows).unsqueeze(1);
    let per_pos = -logp.gather(1, &idx, false);
    let nll = (&per_pos * &w).sum(Kind::Float).double_value(&[]) / (batch.max(1) as f64);
    let onehot = logp.zeros_like().scatter_value(1, &idx, 1.0);
    (nll, (logp.exp() - onehot) * w)
}

/// `KL(p_base ‖ p_post)` per position, averaged: the locality loss. `base` carries no grad.
pub fn kl(base: &Tensor, post: &Tensor) -> Tensor {
    let base_lp = base.to_kind(Kind::Float).log_softmax(-1, Kind::Float);
    kl_from(&base_lp.exp(), &base_lp, post)
}

/// [`kl`] with the base's probabilities and log-probabilities (f32) given, for a base that
/// many measures compare with (the commit guard's reference).
pub fn kl_from(base_p: &Tensor, base_lp: &Tensor, post: &Tensor) -> Tensor {
    let post_lp = post.to_kind(Kind::Float).log_softmax(-1, Kind::Float);
    (base_p * (base_lp - post_lp)).sum_dim_intlist(-1, false, Kind::Float).mean(Kind::Float)
}

/// Per batch row: the share of its kept positions whose argmax is the target, and whether
/// all of them are (whole-answer exact match). `rows` `[N]` names each position's row.
pub fn token_accuracy(logits: &Tensor, targets: &Tensor, rows: &Tensor, batch: i64) -> (Vec<f64>, Vec<bool>) {
    let correct = logits.argmax(-1, false).eq_tensor(targets).to_kind(Kind::Float);
    let zeros = Tensor::zeros([batch], (Kind::Float, logits.device()));
    let hits = zeros.index_add(0, rows, &correct);
    let counts = zeros.index_add(0, rows, &Tensor::ones_like(&correct));
    let hits = Vec::<f64>::try_from(hits.to_kind(Kind::Double).to_device(tch::Device::Cpu)).unwrap_or_default();
    let counts = Vec::<f64>::try_from(counts.to_kind(Kind::Double).to_device(tch::Device::Cpu)).unwrap_or_default();
    hits.iter()
        .zip(&counts)
        .map(|(h, c)| if *c > 0.0 { (h / c, h == c) } else { (0.0, false) })
        .unzip()
}

/// Per batch row: mean over kept positions of `a == b` (top-1 predictions unchanged).
pub fn agreement(a: &Tensor, b: &Tensor, rows: &Tensor, batch: i64) -> Vec<f64> {
    token_accuracy(a, &b.argmax(-1, false), rows, batch).0
}

/// Share of the top-`k` token lists (ranked, entry by entry) of `a` equal to those of `b`
/// over all positions (`[N, V]` each): EasyEdit's locality (k = 1) and multimodal
/// locality (k = 10, `multimodal_locality_acc`). 1 for no positions.
pub fn topk_agreement(a: &Tensor, b: &Tensor, k: i64) -> f64 {
    let n = a.size()[0];
    if n == 0 {
        return 1.0;
    }
    let k = k.min(*a.size().last().unwrap_or(&1)).max(1);
    let (_, ia) = a.to_kind(Kind::Float).topk(k, -1, true, true);
    let (_, ib) = b.to_kind(Kind::Float).to_device(a.device()).topk(k, -1, true, true);
    ia.eq_tensor(&ib).to_kind(Kind::Double).mean(Kind::Double).double_value(&[])
}

/// Per batch row mean NLL of the kept positions.
pub fn nll_per_row(logits: &Tensor, targets: &Tensor, rows: &Tensor, batch: i64) -> Vec<f64> {
    let lp = logits.to_kind(Kind::Float).log_softmax(-1, Kind::Float);
    let nll = -lp.gather(1, &targets.unsqueeze(1), false).squeeze_dim(1);
    let zeros = Tensor::zeros([batch], (Kind::Float, logits.device()));
    let sums = zeros.index_add(0, rows, &nll);
    let counts = zeros.index_add(0, rows, &Tensor::ones_like(&nll));
    Vec::<f64>::try_from((sums / counts.clamp_min(1.0)).to_kind(Kind::Double).to_device(tch::Device::Cpu)).unwrap_or_default()
}
