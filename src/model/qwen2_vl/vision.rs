//! The vision tower: image patches `[P, C·tp·ps·ps]` to merged image tokens `[P/m², D_text]`.
//!
//! Patch embedding (the Conv3d with stride = kernel is one matmul over the flattened
//! patch), 2-D rotary positions (head_dim/4 frequencies for the row, as many for the
//! column, rotate-half), attention within each image (or, in Qwen2.5-VL, within windows
//! of `window_size` pixels except in the `fullatt_block_indexes` blocks), an MLP per
//! family, and the PatchMerger, which concatenates each `m × m` block of neighbouring
//! patches (they are adjacent in the processor's order) and maps it to the text width.
//!
//! Tensor names follow the released checkpoints (`visual.*`); the loader maps
//! `model.visual.*` onto them.
use tch::{Kind, Tensor};

use super::config::{VisionConfig, VlFamily};
use crate::model::layers::{declare_all, Layer, Linear, Norm, Param, ParamList};
use crate::model::params::{Prefix, Scope};
use crate::model::ParamView;
use crate::model::vision::Grid;
use crate::{Error, Result};


/// The patch embedding's weight `[E, C, tp, ps, ps]` (a Conv3d with stride = kernel).
const PATCH_EMBED: &str = "visual.patch_embed.proj.weight";
/// Prefix of the tower's blocks, up to the block index.
const BLOCKS: &str = "visual.blocks";
/// The PatchMerger's module.
const MERGER: &str = "visual.merger";

/// One tower block's layers, named once (relative to `visual.blocks.<i>`).
struct Block {
    norm1: Norm,
    norm2: Norm,
    qkv: Linear,
    proj: Linear,
    mlp: Mlp,
}

/// A tower block's MLP per family.
enum Mlp {
    /// Qwen2-VL: `fc2(act(fc1(x)))`.
    Plain { fc1: Linear, fc2: Linear },
    /// Qwen2.5-VL: `down(act(gate(x)) · up(x))`.
    Gated { gate: Linear, up: Linear, down: Linear },
}

impl Block {
    fn of(v: &VisionConfig) -> Self {
        let (e, f) = (v.width, v.mlp_hidden);
        let norm = |name: &'static str| match v.family {
            VlFamily::Qwen2Vl => Norm::layer(name, e, 1e-6),
            VlFamily::Qwen25Vl => Norm::rms(name, e, 1e-6),
        };
        let mlp = match v.family {
            VlFamily::Qwen2Vl => Mlp::Plain { fc1: Linear::linear("mlp.fc1", e, f, true), fc2: Linear::linear("mlp.fc2", f, e, true) },
            VlFamily::Qwen25Vl => Mlp::Gated {
                gate: Linear::linear("mlp.gate_proj", e, f, true),
                up: Linear::linear("mlp.up_proj", e, f, true),
                down: Linear::linear("mlp.down_proj", f, e, true),
            },
        };
        Block { norm1: norm("norm1"), norm2: norm("norm2"), qkv: Linear::linear("attn.qkv", e, 3 * e, true), proj: Linear::linear("attn.proj", e, e, true), mlp }
    }

    fn layers(&self) -> Vec<&dyn Layer> {
        let mut out: Vec<&dyn Layer> = vec![&self.norm1, &self.norm2, &self.qkv, &self.proj];
        match &self.mlp {
            Mlp::Plain { fc1, fc2 } => out.extend([fc1 as &dyn Layer, fc2]),
            Mlp::Gated { gate, up, down } => out.extend([gate as &dyn Layer, up, down]),
        }
        out
    }
}

/// The PatchMerger's layers (relative to `visual.merger`): a norm, then an MLP over each
/// `m × m` group of patches concatenated.
struct Merger {
    ln_q: Norm,
    fc1: Linear,
    fc2: Linear,
}

impl Merger {
    fn of(v: &VisionConfig) -> Self {
        let (e, merged) = (v.width, v.width * v.merge_unit());
        let ln_q = match v.family {
            VlFamily::Qwen2Vl => Norm::layer("ln_q", e, 1e-6),
            VlFamily::Qwen25Vl => Norm::rms("ln_q", e, 1e-6),
        };
        Merger { ln_q, fc1: Linear::linear("mlp.0", merged, merged, true), fc2: Linear::linear("mlp.2", merged, v.out_dim, true) }
    }
}

/// Every parameter of the tower with its shape, under the `visual.` prefix.
pub fn expected_params(v: &VisionConfig) -> Vec<(String, Vec<i64>)> {
    let mut out = ParamList::new();
    let patch = Param { name: PATCH_EMBED, shape: vec![v.width, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size] };
    patch.declare(&Prefix::default(), &mut out);
    let block = Block::of(v);
    for i in 0..v.depth {
        declare_all(&block.layers(), &Prefix::new(BLOCKS).pp(i), &mut out);
    }
    let m = Merger::of(v);
    declare_all(&[&m.ln_q, &m.fc1, &m.fc2], &Prefix::new(MERGER), &mut out);
    out
}

/// Checks grids against the pixel rows and the merge size; returns the total patch count.
pub fn check_grids(v: &VisionConfig, pixels: &Tensor, grids: &[Grid]) -> Result<i64> {
    let size = pixels.size();
    if size.len() != 2 || size[1] != v.patch_dim() {
        return Err(Error::input(format!(
            "pixel values have shape {size:?}, expected [patches, {}] (C·temporal·patch·patch)",
            v.patch_dim()
        )));
    }
    let m = v.spatial_merge_size;
    let mut total = 0;
    for g in grids {
        if g.iter().any(|&d| d <= 0) || g[1] % m != 0 || g[2] % m != 0 {
            return Err(Error::input(format!("image grid {g:?}: height and width must be positive multiples of {m}")));
        }
        total += g[0] * g[1] * g[2];
    }
    if total != size[0] {
        return Err(Error::input(format!("image grids {grids:?} describe {total} patches, pixel values have {}", size[0])));
    }
    Ok(total)
}

/// Row/column of every patch in the processor's order (each `m × m` merge block
/// contiguous, blocks row-major), repeated for each temporal step: `[N, 2]`.
fn patch_positions(grids: &[Grid], m: i64) -> Vec<[i64; 2]> {
    let mut out = Vec::new();
    for &[t, h, w] in grids {
        for _ in 0..t {
            for bh in 0..h / m {
                for bw in 0..w / m {
                    for ih in 0..m {
                        for iw in 0..m {
                            out.push([bh * m + ih, bw * m + iw]);
                        }
                    }
                }
            }
        }
    }
    out
}

/// Attention segments `[start, len)`: each temporal step of each image.
fn image_segments(grids: &[Grid]) -> Vec<(i64, i64)> {
    let mut out = Vec::new();
    let mut start = 0;
    for &[t, h, w] in grids {
        for _ in 0..t {
            out.push((start, h * w));
            start += h * w;
        }
    }
    out
}

/// Qwen2.5-VL's windows: the order of merged tokens that makes every window contiguous,
/// and the windows as patch segments. Windows are `window_size / (m · patch)` merged
/// tokens on a side, tiled from the top-left; edge windows are smaller, empty ones skipped.
fn window_order(grids: &[Grid], v: &VisionConfig, window_size: i64) -> (Vec<i64>, Vec<(i64, i64)>) {
    let m = v.spatial_merge_size;
    let win = window_size / m / v.patch_size;
    let unit = v.merge_unit();
    let (mut order, mut segments) = (Vec::new(), Vec::new());
    let (mut offset, mut start) = (0i64, 0i64);
    for &[t, h, w] in grids {
        let (lh, lw) = (h / m, w / m);
        let (nwh, nww) = ((lh + win - 1) / win, (lw + win - 1) / win);
        for tt in 0..t {
            for wh in 0..nwh {
                for ww in 0..nww {
                    let mut n = 0;
                    for i in wh * win..((wh + 1) * win).min(lh) {
                        for j in ww * win..((ww + 1) * win).min(lw) {
                            order.push(offset + tt * lh * lw + i * lw + j);
                            n += 1;
                        }
                    }
                    if n > 0 {
                        segments.push((start, n * unit));
                        start += n * unit;
                    }
                }
            }
        }
        offset += t * lh * lw;
    }
    (order, segments)
}

fn rotate_half(x: &Tensor) -> Tensor {
    let halves = x.chunk(2, -1);
    Tensor::cat(&[&(-&halves[1]), &halves[0]], -1)
}

/// The tower over the patches of one or more images.
pub struct VisionTower<'a> {
    pub config: &'a VisionConfig,
}

impl VisionTower<'_> {
    /// cos/sin `[N, 1, head_dim]` (f32) for patches at `pos` (row, column).
    fn rotary(&self, pos: &[[i64; 2]], device: tch::Device) -> (Tensor, Tensor) {
        let spatial = self.config.head_dim() / 2;
        let exponents = Tensor::arange_start_step(0, spatial, 2, (Kind::Int64, device)).to_kind(Kind::Float) / spatial as f64;
        let inv_freq = Tensor::from(self.config.rope_theta as f32).to_device(device).pow(&exponents).reciprocal();
        let flat: Vec<i64> = pos.iter().flat_map(|p| *p).collect();
        let pos = Tensor::from_slice(&flat).to_device(device).reshape([-1, 2]).to_kind(Kind::Float);
        // [N, 2, head_dim/4] -> rows' frequencies then columns', twice over the head dim.
        let freqs = pos.unsqueeze(-1) * inv_freq;
        let hw = Tensor::cat(&[freqs.select(1, 0), freqs.select(1, 1)], -1);
        let emb = Tensor::cat(&[&hw, &hw], -1).unsqueeze(1);
        (emb.cos(), emb.sin())
    }

    /// Self-attention within each segment: `x` `[N, E]`, cos/sin `[N, 1, hd]`.
    fn attention(&self, block: &Block, s: &Scope, x: &Tensor, rope: &(Tensor, Tensor), segments: &[(i64, i64)]) -> Result<Tensor> {
        let v = self.config;
        let (n, nh, hd) = (x.size()[0], v.num_heads, v.head_dim());
        let qkv = block.qkv.forward_frozen(s, x)?.reshape([n, 3, nh, hd]);
        let rot = |t: Tensor| {
            let tf = t.to_kind(Kind::Float);
            (&tf * &rope.0 + rotate_half(&tf) * &rope.1).to_kind(x.kind())
        };
        // [N, H, hd] -> [1, H, N, hd]
        let q = rot(qkv.select(1, 0)).transpose(0, 1).unsqueeze(0);
        let k = rot(qkv.select(1, 1)).transpose(0, 1).unsqueeze(0);
        let val = qkv.select(1, 2).transpose(0, 1).unsqueeze(0);
        let y = if segments.len() == 1 {
            Tensor::scaled_dot_product_attention(&q, &k, &val, None::<Tensor>, 0.0, false, None, false)
        } else {
            let parts: Vec<Tensor> = segments
                .iter()
                .map(|&(s, l)| {
                    Tensor::scaled_dot_product_attention(
                        &q.narrow(2, s, l),
                        &k.narrow(2, s, l),
                        &val.narrow(2, s, l),
                        None::<Tensor>,
                        0.0,
                        false,
                        None,
                        false,
                    )
                })
                .collect();
            Tensor::cat(&parts, 2)
        };
        let y = y.squeeze_dim(0).transpose(0, 1).reshape([n, nh * hd]);
        block.proj.forward_frozen(s, &y)
    }

    fn mlp(&self, block: &Block, s: &Scope, x: &Tensor) -> Result<Tensor> {
        let act = self.config.act;
        Ok(match &block.mlp {
            Mlp::Plain { fc1, fc2 } => {
                let h = act.apply(&fc1.forward_frozen(s, x)?);
                fc2.forward_frozen(s, &h)?
            }
            Mlp::Gated { gate, up, down } => {
                let g = act.apply(&gate.forward_frozen(s, x)?);
                let u = up.forward_frozen(s, x)?;
                down.forward_frozen(s, &(g * u))?
            }
        })
    }

    /// Image tokens `[N / m², out_dim]` for `pixels` `[N, patch_dim]` (the processor's
    /// rows, any float dtype) of the images described by `grids`, in the weights' dtype.
    pub fn forward(&self, p: &ParamView, pixels: &Tensor, grids: &[Grid]) -> Result<Tensor> {
        let v = self.config;
        let n = check_grids(v, pixels, grids)?;
        let w = p.get(PATCH_EMBED)?;
        let device = w.device();
        // Conv3d with stride = kernel over [N, C, tp, ps, ps] = one product with the
        // flattened kernel (same C, tp, ps, ps order as the processor's rows).
        let mut x = pixels.to_device(device).to_kind(w.kind()).matmul(&w.reshape([v.width, -1]).tr());
        let pos = patch_positions(grids, v.spatial_merge_size);
        let mut rope = self.rotary(&pos, device);
        let unit = v.merge_unit();
        let full = image_segments(grids);
        let window = v.window_size.map(|ws| window_order(grids, v, ws));
        // Window attention runs on tokens reordered so each window is contiguous; the merge
        // blocks stay intact (whole blocks move), so merging works on the reordered rows.
        let permute = |t: &Tensor, order: &Tensor| {
            let d = t.size()[1..].to_vec();
            let mut grouped = vec![n / unit, unit];
            grouped.extend_from_slice(&d);
            let mut back = vec![n];
            back.extend_from_slice(&d);
            t.reshape(grouped.as_slice()).index_select(0, order).reshape(back.as_slice())
        };
        let order = match &window {
            Some((order, _)) => {
                let order = Tensor::from_slice(order).to_device(device);
                x = permute(&x, &order);
                rope = (permute(&rope.0, &order), permute(&rope.1, &order));
                Some(order)
            }
            None => None,
        };
        let block = Block::of(v);
        let blocks = Prefix::new(BLOCKS);
        for i in 0..v.depth {
            let s = p.pp(&blocks.pp(i));
            let segments = match &window {
                Some((_, windows)) if !v.fullatt_block_indexes.contains(&i) => windows.as_slice(),
                _ => full.as_slice(),
            };
            let h = block.norm1.forward(&s, &x)?;
            x = &x + self.attention(&block, &s, &h, &rope, segments)?;
            let h = block.norm2.forward(&s, &x)?;
            x = &x + self.mlp(&block, &s, &h)?;
        }
        let m = Merger::of(v);
        let s = p.pp(&Prefix::new(MERGER));
        let h = m.ln_q.forward(&s, &x)?.reshape([n / unit, v.width * unit]);
        let h = m.fc1.forward_frozen(&s, &h)?.gelu("none");
        let out = m.fc2.forward_frozen(&s, &h)?;
        Ok(match order {
            Some(order) => out.index_select(0, &order.argsort(0, false)),
            None => out,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg25(window: i64) -> VisionConfig {
        VisionConfig {
            family: VlFamily::Qwen25Vl,
            depth: 1,
            width: 8,
            num_heads: 2,
            mlp_hidden: 8,
            out_dim: 8,
            act: super::super::config::VisionAct::Silu,
            in_channels: 3,
            patch_size: 14,
            temporal_patch_size: 2,
            spatial_merge_size: 2,
            window_size: Some(window),
            fullatt_block_indexes: vec![],
            rope_theta: 10000.0,
        }
    }

    /// A 5 × 3 merged grid with 2 × 2 windows: windows of 4, 2, 4, 2, 2, 1 tokens, in
    /// window order, every token exactly once.
    #[test]
    fn windows_tile_the_grid_and_skip_nothing() {
        let (order, segs) = window_order(&[[1, 10, 6]], &cfg25(56), 56);
        assert_eq!(order.len(), 15);
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(sorted, (0..15).collect::<Vec<_>>());
        let lens: Vec<i64> = segs.iter().map(|s| s.1 / 4).collect();
        assert_eq!(lens, vec![4, 2, 4, 2, 2, 1]);
        assert_eq!(&order[..4], &[0, 1, 3, 4]);
    }

    #[test]
    fn patch_positions_are_merge_block_major() {
        let pos = patch_positions(&[[1, 2, 4]], 2);
        assert_eq!(pos[..5], [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2]]);
    }
}

