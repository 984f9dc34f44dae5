//! One plan for options whose placement is settled (the boundary of a layer split
//! given): the items of every phase, each device's totals, and the plan's shape.
use crate::config::MendConfig;
use crate::model::loader::dtype_name;
use crate::model::Model;
use crate::Result;

use super::items::{capture, edit, edited_forwards, images, losses_and_step, resident, totals, Items};
use super::sizes::sizes;
use super::types::{MemoryPlan, Phase, PlanOptions, PlanShape};

/// The plan of `model` under `o` as given ([`super::plan_model`] settles a layer split's
/// boundary first).
pub(super) fn plan_fixed(model: &Model, cfg: &MendConfig, o: &PlanOptions) -> Result<MemoryPlan> {
    let z = sizes(model, cfg, o)?;
    let mut it = Items::new(o);
    for phase in [Phase::Train, Phase::Edit] {
        resident(&z, &mut it, phase);
        images(&z, &mut it, phase);
        capture(&z, &mut it, phase);
        edit(&z, &mut it, phase);
        edited_forwards(&z, &mut it, phase);
        losses_and_step(&z, &mut it, phase);
    }
    let totals = totals(&it);
    let shape = PlanShape {
        architecture: z.info.architecture.clone(),
        n_params: z.info.n_params,
        dtype: dtype_name(o.dtype).into(),
        dtype_bytes: z.s,
        main: o.main.clone(),
        sub: o.sub.clone(),
        split: o.split,
        placement: o.placement,
        boundary: z.boundary,
        chain: z.chain.iter().map(|c| (c.device.clone(), c.from)).collect(),
        optimizer_device: o.optimizer_device(),
        batch_size: z.b,
        tokens_per_example: z.tokens,
        kept_per_example: z.kept,
        vocab_size: z.v,
        hidden_size: z.dm.d,
        n_layers: z.dm.n_layers,
        edited: z.names,
        first_edited_layer: z.first_layer,
        editors: z.editors,
        editor_parameters: z.e_params,
        image: z.image.map(|(shape, _)| shape),
        views: z.views.shapes,
        edited_forward_tokens: z.views.fwd_n,
    };
    Ok(MemoryPlan { shape, items: it.items, totals })
}

