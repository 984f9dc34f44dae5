//! JPEG to 8-bit RGB as Pillow (its bundled libjpeg-turbo, then `convert("RGB")`) decodes it,
//! bit for bit: libjpeg-turbo's own arithmetic, from the C source that the `mozjpeg-sys` crate
//! vendors and builds (mozjpeg is libjpeg-turbo's fork; its decoder is libjpeg-turbo's). The
//! settings are Pillow's for a full-size decode: the accurate integer IDCT (`JDCT_ISLOW`),
//! fancy (triangle) chroma upsampling, block smoothing left on, and the output colour space by
//! the number of components as Pillow picks its mode:
//!
//! - 1 component (`L`): grey, repeated into R, G and B;
//! - 3 components (`RGB`): libjpeg's YCbCr → RGB (or RGB as stored, per the Adobe marker);
//! - 4 components (`CMYK`, and YCCK, which libjpeg turns into CMYK): Pillow reads the samples
//!   inverted (`CMYK;I`, the Adobe convention) and converts with `cmyk2rgb`:
//!   `nk = 255 − k`, `out = nk − (c·nk)/255` (rounded as Pillow's `MULDIV255`).
//!
//! Errors never abort: libjpeg's `error_exit` unwinds back here (the C is built with
//! `-fexceptions`) and becomes one error naming the file. A file that ends early is an error,
//! as in Pillow ("image file is truncated"), though libjpeg would fill the rest with grey.
use std::any::Any;
use std::os::raw::c_int;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use mozjpeg_sys as j;

/// What libjpeg reported: the message of the error that stopped it.
struct JpegFailure(String);

/// Per decode: whether libjpeg ran out of data (it warns and inserts an end-of-image marker).
#[derive(Default)]
struct Warnings {
    truncated: bool,
}

fn message(cinfo: &mut j::jpeg_common_struct) -> String {
    let buf = [0u8; 80];
    // SAFETY: `err` was set to a live error manager before any libjpeg call; format_message
    // writes at most 80 bytes, NUL-terminated.
    unsafe {
        if let Some(format) = (*cinfo.err).format_message {
            format(cinfo, &buf);
        }
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// libjpeg's `error_exit`, which must not return: unwinds to [`decode`]'s `catch_unwind`
/// (`resume_unwind` skips the panic hook: nothing is printed).
unsafe extern "C-unwind" fn error_exit(cinfo: &mut j::jpeg_common_struct) {
    let msg = message(cinfo);
    resume_unwind(Box::new(JpegFailure(msg)));
}

/// Warnings (level −1) are counted, and a premature end of the data is remembered; trace
/// messages (level ≥ 0) are dropped. Nothing is printed.
unsafe extern "C-unwind" fn emit_message(cinfo: &mut j::jpeg_common_struct, level: c_int) {
    if level < 0 {
        // SAFETY: as in `message`; client_data is the decode's `Warnings`, alive for the decode.
        unsafe {
            (*cinfo.err).num_warnings += 1;
            if (*cinfo.err).msg_code == j::JWRN_JPEG_EOF {
                (*(cinfo.client_data as *mut Warnings)).truncated = true;
            }
        }
    }
}

unsafe extern "C-unwind" fn output_message(_cinfo: &mut j::jpeg_common_struct) {}

/// Decoded JPEG: `(width, height, RGB rows)`. `max_pixels` bounds the frame header's size
/// before anything is allocated for the pixels. Errors are plain messages (the caller names
/// the file).
pub(super) fn decode(bytes: &[u8], max_pixels: u64) -> std::result::Result<(usize, usize, Vec<u8>), String> {
    // SAFETY: `run` is given a created decompressor.
    let (w, h, comps, samples) = with_decompressor(bytes, |c| unsafe { run(c, max_pixels) })?;
    Ok((w, h, to_rgb(comps, samples)))
}

/// The frame header's `(width, height)`, read without decoding the image (the same parser
/// as [`decode`], so a file is never accepted by one and refused by the other).
pub(super) fn dimensions(bytes: &[u8]) -> std::result::Result<(u32, u32), String> {
    with_decompressor(bytes, |c| {
        // SAFETY: a created decompressor whose source is set.
        unsafe { j::jpeg_read_header(c, 1) };
        Ok((c.image_width, c.image_height))
    })
}

/// Runs `f` on a decompressor reading `bytes`, with the error manager that turns libjpeg's
/// errors into `Err` and a premature end of the data into "truncated"; destroys it after.
fn with_decompressor<T>(
    bytes: &[u8],
    f: impl FnOnce(&mut j::jpeg_decompress_struct) -> std::result::Result<T, String>,
) -> std::result::Result<T, String> {
    let mut err: Box<j::jpeg_error_mgr> = Box::new(unsafe { std::mem::zeroed() });
    let mut warnings = Box::new(Warnings::default());
    let mut cinfo: Box<j::jpeg_decompress_struct> = Box::new(unsafe { std::mem::zeroed() });
    // SAFETY: `err` and `warnings` outlive `cinfo` (declared before it, boxed: stable
    // addresses); every libjpeg call runs inside catch_unwind, and the struct is destroyed
    // once created.
    unsafe {
        j::jpeg_std_error(&mut err);
        err.error_exit = Some(error_exit);
        err.emit_message = Some(emit_message);
        err.output_message = Some(output_message);
        cinfo.common.err = &mut *err;
        cinfo.common.client_data = &mut *warnings as *mut Warnings as *mut std::ffi::c_void;
    }
    catch_unwind(AssertUnwindSafe(|| unsafe { j::jpeg_create_decompress(&mut *cinfo) })).map_err(failure)?;
    let out = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: created above; `bytes` outlives the decompressor.
        unsafe { j::jpeg_mem_src(&mut cinfo, bytes.as_ptr(), bytes.len() as _) };
        f(&mut cinfo)
    }));
    // SAFETY: created above; destroying also frees what an interrupted decode allocated.
    let _ = catch_unwind(AssertUnwindSafe(|| unsafe { j::jpeg_destroy_decompress(&mut cinfo) }));
    let out = out.map_err(failure)??;
    if warnings.truncated {
        return Err("image file is truncated (the JPEG data ends before the image does)".into());
    }
    Ok(out)
}

fn failure(e: Box<dyn Any + Send>) -> String {
    match e.downcast::<JpegFailure>() {
        Ok(f) => f.0,
        Err(e) => resume_unwind(e), // a real bug, not a libjpeg error
    }
}

/// Reads the header, picks Pillow's output colour space, decodes every scanline.
/// Returns `(width, height, components, samples)`.
unsafe fn run(cinfo: &mut j::jpeg_decompress_struct, max_pixels: u64) -> std::result::Result<(usize, usize, usize, Vec<u8>), String> {
    unsafe {
        j::jpeg_read_header(cinfo, 1);
        let (w, h) = (cinfo.image_width as u64, cinfo.image_height as u64);
        if w == 0 || h == 0 {
            return Err("image has no pixels".into());
        }
        if w * h > max_pixels {
            return Err(format!("image is {w}×{h} pixels, more than the {max_pixels} allowed"));
        }
        cinfo.out_color_space = match cinfo.num_components {
            1 => j::J_COLOR_SPACE::JCS_GRAYSCALE,
            3 => j::J_COLOR_SPACE::JCS_RGB,
            4 => j::J_COLOR_SPACE::JCS_CMYK,
            n => return Err(format!("a JPEG with {n} components (Pillow opens 1, 3 or 4)")),
        };
        j::jpeg_start_decompress(cinfo);
        let (w, h, comps) = (cinfo.output_width as usize, cinfo.output_height as usize, cinfo.output_components as usize);
        let row = w * comps;
        let mut samples = vec![0u8; row * h];
        while (cinfo.output_scanline as usize) < h {
            let y = cinfo.output_scanline as usize;
            let mut line = [samples[y * row..].as_mut_ptr()];
            if j::jpeg_read_scanlines(cinfo, line.as_mut_ptr(), 1) != 1 {
                return Err("the JPEG decoder returned no scanline".into());
            }
        }
        j::jpeg_finish_decompress(cinfo);
        Ok((w, h, comps, samples))
    }
}

/// Pillow's `MULDIV255(a, b)`: `a·b/255` rounded, in integers.
fn muldiv255(a: i32, b: i32) -> i32 {
    let t = a * b + 128;
    ((t >> 8) + t) >> 8
}

/// Samples in the decoded colour space to RGB as Pillow converts its mode.
fn to_rgb(comps: usize, samples: Vec<u8>) -> Vec<u8> {
    match comps {
        3 => samples,
        1 => samples.into_iter().flat_map(|l| [l, l, l]).collect(),
        _ => samples
            .chunks_exact(4)
            .flat_map(|p| {
                // `CMYK;I`: the stored samples inverted, then `cmyk2rgb`.
                let [c, m, y, k] = [0, 1, 2, 3].map(|i| 255 - p[i] as i32);
                let nk = 255 - k;
                [c, m, y].map(|v| (nk - muldiv255(v, nk)).clamp(0, 255) as u8)
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_and_truncation_are_errors_not_aborts() {
        assert!(decode(b"\xff\xd8\xff\xe0 not really", 1 << 20).is_err());
        assert!(decode(b"", 1 << 20).is_err());
    }

    #[test]
    fn muldiv255_rounds_as_pillow() {
        assert_eq!(muldiv255(255, 255), 255);
        assert_eq!(muldiv255(0, 255), 0);
        assert_eq!(muldiv255(128, 255), 128);
        assert_eq!(muldiv255(1, 128), 1);
    }
}
