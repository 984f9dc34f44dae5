//! `dualedit compare train|eval`: the same run on main alone and split over main + sub.
use crate::cli::args::CompareCmd;

pub fn run(c: CompareCmd) -> anyhow::Result<()> {
    let devices = match &c {
        CompareCmd::Train(a) => &a.common.devices,
        CompareCmd::Eval(a) => &a.common.devices,
    };
    let json = matches!(&c, CompareCmd::Eval(a) if a.json);
    if devices.sub_device.is_none() {
        anyhow::bail!("compare needs --sub-device (the dual side's sub-device)");
    }
    // The dual side is placed as --placement asks; the single side is main alone.
    let (cmp, out) = match c {
        CompareCmd::Train(a) => {
            let o = super::train::options(a)?;
            let dual = o.common.plan;
            (crate::run::compare::compare_train(&o, dual)?, o.out.clone())
        }
        CompareCmd::Eval(a) => {
            let o = super::eval::options(&a)?;
            let dual = o.common.plan;
            let out = a.common.report.as_ref().and_then(|p| p.parent().map(|p| p.to_path_buf())).unwrap_or_else(|| {
                crate::run::report::default_path("compare").with_extension("")
            });
            (crate::run::compare::compare_eval(&o, dual, &out)?, out)
        }
    };
    let report = out.join("compare.json");
    if json {
        let mut v = serde_json::to_value(&cmp)?;
        v["report"] = serde_json::Value::from(report.display().to_string());
        println!("{v}");
    } else {
        print!("{}", crate::run::compare::table(&cmp));
        println!("report: {}", report.display());
    }
    Ok(())
}
