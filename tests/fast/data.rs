//! The EasyEdit readers on the real shared datasets (`../shared/data`), skipped with a
//! line on stderr when that folder is absent, a failure under `DUALEDIT_REQUIRE_SHARED=1`.
use crate::common;

use dualedit::data::easyedit::{load_records, DatasetKind};

#[test]
fn real_shared_files() {
    let Some(dir) = common::shared_data_dir() else { return };

    let (zsre, report) =
        load_records(&dir.join("zsre/zsre_mend_train-1k.json"), DatasetKind::Zsre).unwrap();
    assert_eq!(zsre.len() + report.skipped.len(), 1000);
    assert_eq!(zsre.len(), 998);
    assert_eq!(report.skipped.len(), 2);
    assert!(
        report
            .skipped
            .iter()
            .all(|(_, why)| why.contains("\"alt\"")),
        "{:?}",
        report.skipped
    );
    assert!(zsre
        .iter()
        .all(|r| r.ground_truth.is_some() && r.locality_prompt.is_some()));

    for (file, n) in [
        ("counterfact/counterfact-train.json", 10000),
        ("counterfact/counterfact-val.json", 1919),
    ] {
        for kind in [DatasetKind::Counterfact, DatasetKind::Requests] {
            let (recs, report) = load_records(&dir.join(file), kind).unwrap();
            assert_eq!(recs.len(), n, "{file} as {kind}");
            assert!(report.skipped.is_empty(), "{file}: {:?}", report.skipped);
            assert!(recs
                .iter()
                .all(|r| r.rephrase.is_some() && r.locality_ground_truth.is_some()));
        }
    }
}
