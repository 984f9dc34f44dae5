//! JPEG decoded as Pillow decodes it (issue #48): every file of tests/fixtures/jpeg (written by
//! Pillow and by imagecodecs' libjpeg-turbo: baseline, progressive, every chroma subsampling,
//! greyscale, CMYK, YCCK, restart markers, EXIF, odd sizes; scripts/make_jpeg_fixtures.py)
//! gives exactly the RGB of Pillow's `Image.open(f).convert("RGB")`, and broken files give one
//! error naming the file.
use dualedit::model::vision::image;

use crate::common::{fixture, json_file};

#[test]
fn every_kind_of_jpeg_decodes_to_pillows_pixels() {
    let dir = fixture("jpeg");
    let manifest = json_file(&dir.join("manifest.json"));
    let files = manifest["files"].as_object().unwrap();
    assert!(files.len() >= 20, "{manifest}");
    let mut differ = Vec::new();
    // The fixtures tell decoders apart: the `image` crate's jpeg-decoder (what dualedit used
    // before) rounds its IDCT and upsampling otherwise and misses Pillow on some of them.
    let mut other_decoder_misses = 0;
    for (name, meta) in files {
        let ours = image::decode(&dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let pillow = image::decode(&dir.join("pillow").join(name.replace(".jpg", ".png"))).unwrap();
        assert_eq!((ours.width, ours.height), (pillow.width, pillow.height), "{name}");
        assert_eq!((ours.width as u64, ours.height as u64), (meta["width"].as_u64().unwrap(), meta["height"].as_u64().unwrap()));
        let worst = ours.data.iter().zip(&pillow.data).map(|(a, b)| a.abs_diff(*b)).max().unwrap();
        let n = ours.data.iter().zip(&pillow.data).filter(|(a, b)| a != b).count();
        let theirs = ::image::load_from_memory_with_format(&std::fs::read(dir.join(name)).unwrap(), ::image::ImageFormat::Jpeg);
        if theirs.map_or(true, |t| meta["mode"] == "RGB" && t.to_rgb8().into_raw() != pillow.data) {
            other_decoder_misses += 1;
        }
        if n > 0 {
            differ.push(format!("{name} ({}): {n} of {} samples differ, by up to {worst}", meta["written_by"], ours.data.len()));
        }
    }
    assert!(other_decoder_misses >= 5, "only {other_decoder_misses} files tell decoders apart");
    assert!(differ.is_empty(), "not Pillow's pixels (Pillow {}, libjpeg-turbo {}):\n{}", manifest["pillow"], manifest["libjpeg_turbo"], differ.join("\n"));
}

#[test]
fn broken_jpegs_are_one_error_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let good = std::fs::read(fixture("jpeg").join("progressive_420.jpg")).unwrap();
    let mut cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("cut_in_scan.jpg", good[..good.len() * 2 / 3].to_vec(), "truncated"),
        ("cut_in_header.jpg", good[..40].to_vec(), "jpg"),
        ("soi_only.jpg", vec![0xff, 0xd8, 0xff], "jpg"),
    ];
    // A frame header that claims 65535 x 65535 pixels (SOF0's height and width fields).
    let mut huge = std::fs::read(fixture("jpeg").join("baseline_420.jpg")).unwrap();
    let sof = huge.windows(2).position(|w| w == [0xff, 0xc0]).unwrap();
    huge[sof + 5..sof + 9].copy_from_slice(&[0xff, 0xff, 0xff, 0xff]);
    cases.push(("huge.jpg", huge, "pixels"));
    // Scan data replaced by noise: libjpeg warns and goes on, as Pillow does; no abort.
    let mut noisy = good.clone();
    let n = noisy.len();
    for (i, b) in noisy[n / 2..n - 2].iter_mut().enumerate() {
        *b = (i * 131 % 251) as u8;
    }
    for (name, bytes, says) in cases {
        let p = tmp.path().join(name);
        std::fs::write(&p, &bytes).unwrap();
        let e = image::decode(&p).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains(name) && e.contains(says) && !e.contains('\n'), "{name}: {e}");
    }
    let p = tmp.path().join("noisy.jpg");
    std::fs::write(&p, &noisy).unwrap();
    let _ = image::decode(&p); // an error or grey-filled pixels, never a crash
}
