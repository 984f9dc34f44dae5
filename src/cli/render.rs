//! What the commands print for a person (their `--json` output is the library's types).
use std::path::Path;

use crate::config::SelectBy;
use crate::edit::capacity::Grouping;
use crate::edit::eval::Summary;
use crate::edit::score::Score;
use crate::mend::guard::Decision;
use crate::model::Tokenizer;
use crate::run::{EditOutput, EvalOutput};
use crate::mend::train::TrainReport;

/// `score`: one line per scored token, then the mean NLL.
pub fn score(s: &Score, tokenizer: &Tokenizer) {
    if s.image_tokens > 0 {
        println!("image: {} image tokens (and a start and an end marker) before the text", s.image_tokens);
    }
    // Without an image the first token has nothing before it and is not scored.
    let first = s.tokens.len() - s.logprobs.len();
    println!("{:>6}  {:>10}  token", "pos", "logprob");
    for (i, lp) in s.logprobs.iter().enumerate() {
        let piece = tokenizer.decode(&[s.tokens[i + first]]).unwrap_or_default();
        println!("{:>6}  {:>10.4}  {:?}", i + first, lp, piece);
    }
    println!("mean NLL {:.4} over {} tokens", s.mean_nll, s.logprobs.len());
}

/// `train`: steps, the best validation score, speed, where the editor and report are.
pub fn trained(rep: &TrainReport, select_by: SelectBy, report: &Path) {
    let (what, best) = match select_by {
        SelectBy::Loss => ("loss", rep.best_val_loss),
        SelectBy::Accuracy => ("edit_acc + loc_acc", -rep.best_val_loss),
    };
    println!(
        "trained {} steps ({} skipped), best validation {what} {best:.4}, {:.3} s/step; editor in {}",
        rep.steps,
        rep.skipped_steps,
        rep.seconds_per_step,
        rep.editor_dir.display()
    );
    println!("report: {}", report.display());
}

/// EasyEdit's metrics as a two-column table (with the five multimodal ones for image edits).
pub fn summary(s: &Summary) {
    print!("{}", crate::run::summary_table(s));
}

/// `edit`: each request's answer and metrics, the guard's decisions, the summary.
pub fn edited(out: &EditOutput, report: &Path) {
    let (saved, out) = (&out.saved, &out.outcome);
    for (i, r) in out.requests.iter().enumerate() {
        println!("{}", crate::run::request_line(i, r));
    }
    let refused = out.guard.iter().filter(|g| g.decision == Decision::Refused).count();
    let scaled = out.guard.iter().filter(|g| g.decision == Decision::Scaled).count();
    if refused + scaled > 0 {
        println!("guard: {refused} edit(s) refused, {scaled} scaled back, of {} (see the report's \"guard\")", out.guard.len());
    }
    let conflicts = out.conflicts.len();
    if conflicts > 0 {
        println!("conflicts: {conflicts} between requests of this call (see the report's \"conflicts\")");
    }
    println!("method {}", out.method);
    summary(&out.summary);
    if let Some(dir) = saved {
        println!("edited model saved to {}", dir.display());
    }
    println!("report: {}", report.display());
}

/// `eval`: the method, the capacity measurement when there was one, the summary.
pub fn evaluated(out: &EvalOutput, report: &Path) {
    println!("method {}", out.method);
    if let Some(c) = &out.capacity {
        let (mode, n) = match c.grouping {
            Grouping::Batch(n) => ("in one batch", n),
            Grouping::Sequential(n) => ("one after another", n),
        };
        println!("{} group(s) of up to {n} edits {mode}, measured after each group's last edit; {:.4} s per edit", c.groups, c.seconds_per_edit);
        if let Some(d) = &c.drift {
            println!("unrelated-text NLL ({} texts): {:.4} -> {:.4} ({:+.4})", d.texts, d.nll_before, d.nll_after, d.nll_after - d.nll_before);
        }
        if c.guard_accepted + c.guard_scaled + c.guard_refused > 0 {
            println!("guard: {} accepted, {} scaled back, {} refused", c.guard_accepted, c.guard_scaled, c.guard_refused);
        }
        if c.locality_conflicts + c.contradictions > 0 {
            println!(
                "conflicts: {} locality prompt(s) naming a subject edited in their group (left out of the guard), {} contradictory pair(s)",
                c.locality_conflicts, c.contradictions
            );
        }
    }
    summary(&out.summary);
    println!("report: {}", report.display());
}
