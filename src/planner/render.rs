//! A plan as text: its items, formulas and each device's peak per phase.
use std::fmt::Write as _;


use crate::device::memory::format_bytes;

use super::types::{num, Group, MemoryPlan, Phase, Role, ViewShape};


impl MemoryPlan {
    /// Peak bytes of `device` in `phase` (0 if the device has no role).
    pub fn peak(&self, device: &str, phase: Phase) -> u64 {
        self.totals.iter().find(|t| t.device == device && t.phase == phase).map_or(0, |t| t.peak_bytes)
    }

    /// Bytes of one group on `device` in `phase`.
    pub fn group_bytes(&self, device: &str, phase: Phase, group: Group) -> u64 {
        self.totals
            .iter()
            .find(|t| t.device == device && t.phase == phase)
            .and_then(|t| t.by_group.get(&group).copied())
            .unwrap_or(0)
    }

    /// The plan as a text table: every item with its bytes and, under it, its formula;
    /// then each device's peak per phase.
    pub fn table(&self) -> String {
        let sh = &self.shape;
        let mut out = String::new();
        let placement = if sh.split {
            format!("main {}, sub {} (split), placement {}", sh.main, sh.sub, self.placement_label())
        } else {
            format!("main = sub = {} (single device)", sh.main)
        };
        let _ = writeln!(out, "memory plan: {} ({} parameters, {}), {placement}", sh.architecture, num(sh.n_params), sh.dtype);
        let _ = writeln!(
            out,
            "assumes batch {} x {} tokens with {} labelled positions per example; {} edited weights from layer {} on; {} editor(s), {} parameters",
            sh.batch_size,
            sh.tokens_per_example,
            sh.kept_per_example,
            sh.edited.len(),
            sh.first_edited_layer,
            sh.editors.len(),
            num(sh.editor_parameters)
        );
        let _ = writeln!(
            out,
            "s = {} bytes per weight element; B batch, T tokens, kept labelled positions, V vocabulary, P edited weights",
            sh.dtype_bytes
        );
        if let Some(im) = &sh.image {
            let _ = writeln!(
                out,
                "image {}x{} -> {}x{}: {} patches, {} tokens; {} distinct images per example, each through the tower once per step",
                im.size.0, im.size.1, im.resized.0, im.resized.1, im.patches, im.tokens, im.images_per_example
            );
        }
        out.push_str(&views_text(&sh.views, sh.edited_forward_tokens));
        let _ = writeln!(out, "a device's peak = its resident items + the largest of its other groups (they are never alive together)");
        for phase in [Phase::Train, Phase::Edit] {
            let title = match phase {
                Phase::Train => "TRAIN: one meta-training micro-step, the optimiser step, a checkpoint write",
                Phase::Edit => "EDIT: one edit with a trained editor, then scoring the edited model",
            };
            let _ = writeln!(out, "\n{title}");
            let _ = writeln!(out, "{:<5} {:<25} {:>10}  item / formula", "role", "alive during", "bytes");
            for it in self.items.iter().filter(|i| i.phase == phase) {
                let when: Vec<&str> = it.groups.iter().map(|g| g.name()).collect();
                let _ = writeln!(out, "{:<5} {:<25} {:>10}  {}", it.role.name(), when.join(","), format_bytes(it.bytes), it.item);
                let _ = writeln!(out, "{:<5} {:<25} {:>10}    = {}", "", "", "", it.formula);
            }
            for t in self.totals.iter().filter(|t| t.phase == phase) {
                let groups: Vec<String> = t
                    .by_group
                    .iter()
                    .filter(|(g, _)| **g != Group::Resident)
                    .map(|(g, b)| format!("{} {}", g.name(), format_bytes(*b)))
                    .collect();
                let _ = writeln!(
                    out,
                    "PEAK {} ({}): {}  = resident {} + {} (largest of: {})",
                    t.device,
                    t.roles.join("+"),
                    format_bytes(t.peak_bytes),
                    format_bytes(t.by_group.get(&Group::Resident).copied().unwrap_or(0)),
                    t.peak_group.name(),
                    groups.join(", ")
                );
            }
            if phase == Phase::Train && sh.main != "cpu" {
                let host: u64 = self.items.iter().filter(|i| i.phase == phase && i.role == Role::Host).map(|i| i.bytes).sum();
                let _ = writeln!(out, "host memory (not on {}): {} while a checkpoint is written", sh.main, format_bytes(host));
            }
        }
        out
    }
}

/// The views as text: one line each (rows × tokens, of which image, labelled), then the
/// edited forward's tokens.
pub(super) fn views_text(views: &[ViewShape], fwd_tokens: i64) -> String {
    let mut out = String::from("views of one micro-batch (rows x tokens per row, image tokens, labelled positions per row):\n");
    for v in views {
        let role = if v.edited { "edited forward" } else { "capture" };
        let _ = writeln!(out, "  {:<17} {:>3} x {:>5}  image {:>5}  labelled {:>4}  [{role}]", v.name, v.rows, v.tokens, v.image_tokens, v.kept);
    }
    let _ = writeln!(out, "  the edited forward runs one batch of the edited views padded to the longest: {fwd_tokens} tokens");
    out
}
