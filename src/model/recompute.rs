//! Gradients of a loss of the logits w.r.t. block weights, with each block recomputed in
//! the backward instead of keeping its activations (activation checkpointing by hand: tch
//! has no checkpoint API).
//!
//! 1. Forward without grad, keeping only the input of every block from the first one that
//!    reads a differentiated weight (the blocks below it need no gradient at all).
//! 2. The final head and the caller's loss with grad, from a leaf copy of the last hidden
//!    state: the loss and `∂loss/∂hidden`.
//! 3. From the last block down to the first differentiated one: recompute the block with
//!    grad from a leaf copy of its saved input, and backpropagate the incoming gradient `g`
//!    with [`Tensor::run_backward`] on the surrogate `Σ y·g` (tch's `run_backward` seeds
//!    every root with ones and takes no gradient argument; `∂(Σ y·g)/∂y = g` exactly).
//!    That gives the gradient for the block's input (the next `g`) and for the weights
//!    the block reads.
//!
//! At most one block's activations are alive at a time, next to the saved block inputs
//! (`B·T·D` each). The price is one more forward of the blocks from the first
//! differentiated one up. Forwards are deterministic, so the recomputed block equals the
//! one of the first pass and the gradients equal those of an ordinary backward (to float
//! rounding of the accumulation order).
use std::collections::{BTreeMap, HashSet};

use tch::{Kind, Tensor};

use super::{BlockIo, ForwardInput, Model, ParamView};
use crate::{Error, Result};

/// Adds `∂loss/∂w` into `grads[k]` for every `w = wrt[k]` (setting it where `None`, as
/// autograd accumulates into `.grad`), where `loss` is computed by `loss_fn` from the
/// logits of `model` at `input.keep` (as [`Model::forward`] returns them) and the forward
/// reads its weights from `p`. Each block's gradients are added as soon as they exist, so
/// a sum over several batches holds one set of weight gradients plus one block's.
///
/// Every name in `wrt` must be a weight read by a transformer block whose tensor in `p` is
/// a leaf that requires grad (an override); gradients are on that tensor's device.
/// `loss_fn` may move the logits elsewhere (the gradient flows back through the copy) and
/// must return a scalar that depends on them. `grads` must have `wrt.len()` entries.
pub fn grad_by_blocks(
    model: &Model,
    p: &ParamView,
    input: &ForwardInput,
    wrt: &[String],
    grads: &mut [Option<Tensor>],
    loss_fn: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<()> {
    if grads.len() != wrt.len() {
        return Err(Error::Internal(format!("{} gradient slots for {} weights", grads.len(), wrt.len())));
    }
    let blocks: Vec<usize> = wrt
        .iter()
        .map(|n| {
            model.block_of(n).ok_or_else(|| {
                Error::input(format!("{n:?} is not read by a transformer block: recomputation differentiates block weights only"))
            })
        })
        .collect::<Result<_>>()?;
    let Some(&first) = blocks.iter().min() else {
        return Ok(());
    };
    let n = model.n_blocks();
    // Under a layer split every differentiated block must be on the sub-device, so the
    // one crossing happens in the forward without grad and the backward stays there.
    if let Some(split) = p.layer_split().filter(|s| s.at > first) {
        return Err(Error::input(format!(
            "block {first} is differentiated but below the layer split's boundary ({}): the blocks that need gradients must be on the sub-device",
            split.at
        )));
    }
    let none = HashSet::new();
    let mut scratch = BTreeMap::new();
    crate::error::guard(|| {
        // The last block runs at the kept rows only, in both passes (as in the forward).
        let rows = model.query_rows(p, input)?;
        // 1. Forward without grad, keeping the inputs of blocks `first..n`.
        let (mut inputs, last, ctx) = tch::no_grad(|| -> Result<_> {
            // From the boundary activations when given: the blocks below it ran once per batch.
            let (start, mut x, mut ctx) = match input.entry {
                Some(e) => {
                    model.check_entry(p, input, e)?;
                    if e.at > first {
                        return Err(Error::Torch(format!("a prefix to block {} skips block {first}, which is differentiated", e.at)));
                    }
                    (e.at, e.x.shallow_clone(), e.context())
                }
                None => {
                    let (x, ctx) = model.embed(p, input, 0)?;
                    (0, x, ctx)
                }
            };
            let mut inputs = Vec::with_capacity(n - first);
            for i in start..n {
                if let Some(c) = p.crossing_at(i).filter(|_| input.entry.is_none()) {
                    x = c.boundary_to_sub(&x);
                    ctx = ctx.crossed(c);
                }
                let y = model.block(BlockIo { rows: rows.as_ref().filter(|_| i + 1 == n), ..BlockIo::plain(p, i, &x, &ctx, &none, &mut scratch) })?;
                if i >= first {
                    inputs.push(x);
                }
                x = y;
            }
            Ok((inputs, x, ctx))
        })?;

        // 2. Head and loss from a leaf of the last hidden state.
        let mut g = tch::with_grad(|| -> Result<Tensor> {
            let h = last.set_requires_grad(true);
            let keep = input.keep.map(|k| match p.layer_split() {
                Some(s) => s.cross.to_sub(k),
                None => k.shallow_clone(),
            });
            let logits = model.head_at(p, &h, keep.as_ref(), rows.as_ref())?;
            let loss = loss_fn(&logits)?;
            Ok(Tensor::f_run_backward(&[&loss], &[&h], false, false)?.remove(0))
        })?;

        // 3. Blocks from the top down: recompute, backpropagate `g`.
        for i in (first..n).rev() {
            let x = inputs.pop().ok_or_else(|| Error::Internal("recomputation lost a block input".into()))?;
            let mine: Vec<usize> = (0..wrt.len()).filter(|&k| blocks[k] == i).collect();
            // The lowest block's input does not depend on anything differentiated.
            let need_input = i > first;
            let mut out = tch::with_grad(|| -> Result<Vec<Tensor>> {
                let x = x.set_requires_grad(need_input);
                let y = model.block(BlockIo { rows: rows.as_ref().filter(|_| i + 1 == n), ..BlockIo::plain(p, i, &x, &ctx, &none, &mut scratch) })?;
                let surrogate = (y * &g).sum(Kind::Float);
                let mut leaves: Vec<&Tensor> = Vec::with_capacity(mine.len() + 1);
                if need_input {
                    leaves.push(&x);
                }
                for &k in &mine {
                    leaves.push(p.get(&wrt[k])?);
                }
                if leaves.is_empty() {
                    return Ok(Vec::new());
                }
                Ok(Tensor::f_run_backward(&[&surrogate], &leaves, false, false)?)
            })?;
            if need_input {
                g = out.remove(0);
            }
            for (&k, grad) in mine.iter().zip(out) {
                if !grad.defined() {
                    return Err(Error::Internal(format!("{:?} does not reach the loss", wrt[k])));
                }
                match &mut grads[k] {
                    Some(sum) => *sum += &grad,
                    slot => *slot = Some(grad),
                }
            }
        }
        Ok(())
    })
}
