//! The image file (RTCR's cold storage, and what migrates): a checkpoint
//! serialized so that another process, on this machine or another, can
//! restore it.
//!
//! Format, version 1:
//!
//! | bytes | what |
//! | --- | --- |
//! | 8 | magic `KSGCKPT\0` |
//! | 4 | format version, little-endian (1) |
//! | 4 | flags, 0 |
//! | rest | one zstd frame with its content checksum, holding: |
//! | · 8 | length of the manifest, little-endian |
//! | · n | the manifest: `postcard` encoding of [`Manifest`] |
//! | · … | the populated pages of each area, in the manifest's order |
//! | · … | each attachment's bytes, in the manifest's order |
//! | · 4 | CRC-32 of everything above in the frame, little-endian |
//!
//! Attachments are named byte strings that travel with the image: the
//! supervisor puts the component's vault records and durable memory there
//! when it exports a checkpoint (RTCR's marshalling for migration).
//!
//! `postcard` is a compact, stable serde encoding (its wire format is
//! specified and versioned 1.0); the pages are raw bytes after it rather
//! than inside it so that a 1 GiB image streams through zstd without a
//! second copy. Reading checks the magic, the version, every bound of the
//! manifest (page alignment, user addresses, runs inside their area, no
//! overlap, a total span under [`MAX_SPAN`]) before allocating, the CRC and
//! zstd's checksum after, and that nothing follows: a truncated, corrupted
//! or foreign file is refused with the reason, and nothing is restored
//! from it.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::image::{Area, Image, ThreadState};
use crate::maps::{Mapping, PAGE};

pub const MAGIC: &[u8; 8] = b"KSGCKPT\0";
pub const VERSION: u32 = 1;
/// The largest total of mapping sizes an image may describe.
pub const MAX_SPAN: u64 = 64 << 30;
const MAX_MANIFEST: u64 = 64 << 20;
/// The top of x86-64 user space.
const USER_END: u64 = 0x0000_8000_0000_0000;

/// Why an image file was refused.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: not a kintsugi checkpoint image (magic {found:02x?})")]
    Foreign { path: String, found: Vec<u8> },
    #[error("{path}: image format version {found}, this build reads version {VERSION}")]
    Version { path: String, found: u32 },
    #[error("{path}: truncated or corrupted: {detail}")]
    Corrupt { path: String, detail: String },
    #[error("{path}: invalid manifest: {detail}")]
    Invalid { path: String, detail: String },
}

/// What the image holds, before its pages.
#[derive(Debug, Serialize, Deserialize)]
pub struct Manifest {
    pub pid: u32,
    pub exe: String,
    pub seq: u64,
    pub layout: Vec<Mapping>,
    pub shared: Vec<Mapping>,
    pub brk: (u64, u64),
    pub threads: Vec<ThreadState>,
    pub areas: Vec<AreaManifest>,
    /// Each attachment's name and length in bytes.
    pub attachments: Vec<(String, u64)>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct AreaManifest {
    pub map: Mapping,
    /// The populated runs whose bytes follow, absolute addresses.
    pub runs: Vec<(u64, u64)>,
}

/// Writes `image` to `path` (through a temporary file renamed into place).
pub fn write(image: &Image, path: &Path) -> Result<u64, ImageError> {
    let io = |source| ImageError::Io {
        path: path.display().to_string(),
        source,
    };
    let manifest = Manifest {
        pid: image.pid,
        exe: image.exe.clone(),
        seq: image.seq,
        layout: image.layout.clone(),
        shared: image.shared.clone(),
        brk: image.brk,
        threads: image.threads.clone(),
        areas: image
            .areas
            .values()
            .map(|a| AreaManifest {
                map: a.map.clone(),
                runs: a.populated_runs(),
            })
            .collect(),
        attachments: image
            .attachments
            .iter()
            .map(|(k, v)| (k.clone(), v.len() as u64))
            .collect(),
    };
    let encoded = postcard::to_stdvec(&manifest).map_err(|e| io(std::io::Error::other(e)))?;
    // Unique per write: two threads may write the same path at once.
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
    let file = File::create(&tmp).map_err(io)?;
    let mut out = BufWriter::new(file);
    out.write_all(MAGIC).map_err(io)?;
    out.write_all(&VERSION.to_le_bytes()).map_err(io)?;
    out.write_all(&0u32.to_le_bytes()).map_err(io)?;
    let mut z = zstd::Encoder::new(out, 1).map_err(io)?;
    z.include_checksum(true).map_err(io)?;
    let mut crc = crc32fast::Hasher::new();
    let mut put = |z: &mut zstd::Encoder<'_, BufWriter<File>>, b: &[u8]| {
        crc.update(b);
        z.write_all(b)
    };
    put(&mut z, &(encoded.len() as u64).to_le_bytes()).map_err(io)?;
    put(&mut z, &encoded).map_err(io)?;
    for (a, m) in image.areas.values().zip(&manifest.areas) {
        for &(s, e) in &m.runs {
            put(&mut z, a.bytes(s, e)).map_err(io)?;
        }
    }
    for bytes in image.attachments.values() {
        put(&mut z, bytes).map_err(io)?;
    }
    let sum = crc.finalize();
    z.write_all(&sum.to_le_bytes()).map_err(io)?;
    let out = z.finish().map_err(io)?;
    let file = out.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    std::fs::rename(&tmp, path).map_err(io)?;
    Ok(len)
}

/// Reads and checks an image file.
pub fn read(path: &Path) -> Result<Image, ImageError> {
    let name = path.display().to_string();
    let corrupt = |detail: String| ImageError::Corrupt {
        path: name.clone(),
        detail,
    };
    let file = File::open(path).map_err(|source| ImageError::Io {
        path: name.clone(),
        source,
    })?;
    let mut input = BufReader::new(file);
    let mut head = [0u8; 16];
    let got = read_full(&mut input, &mut head).map_err(|e| corrupt(e.to_string()))?;
    if got < 8 || &head[..8] != MAGIC {
        return Err(ImageError::Foreign {
            path: name.clone(),
            found: head[..got.min(8)].to_vec(),
        });
    }
    if got < 16 {
        return Err(corrupt("header cut short".into()));
    }
    let version = u32::from_le_bytes(head[8..12].try_into().unwrap_or_default());
    if version != VERSION {
        return Err(ImageError::Version {
            path: name.clone(),
            found: version,
        });
    }
    let flags = u32::from_le_bytes(head[12..16].try_into().unwrap_or_default());
    if flags != 0 {
        return Err(corrupt(format!("unknown flags {flags:#x}")));
    }
    let z = zstd::Decoder::with_buffer(input).map_err(|e| corrupt(e.to_string()))?;
    let mut body = Checked {
        inner: z,
        crc: crc32fast::Hasher::new(),
    };
    let mut len = [0u8; 8];
    body.read_exact(&mut len)
        .map_err(|e| corrupt(format!("manifest length: {e}")))?;
    let len = u64::from_le_bytes(len);
    if len > MAX_MANIFEST {
        return Err(corrupt(format!("manifest of {len} bytes")));
    }
    let mut encoded = vec![0u8; len as usize];
    body.read_exact(&mut encoded)
        .map_err(|e| corrupt(format!("manifest: {e}")))?;
    let manifest: Manifest =
        postcard::from_bytes(&encoded).map_err(|e| corrupt(format!("manifest: {e}")))?;
    validate(&manifest).map_err(|detail| ImageError::Invalid {
        path: name.clone(),
        detail,
    })?;
    let mut image = Image {
        pid: manifest.pid,
        exe: manifest.exe,
        seq: manifest.seq,
        layout: manifest.layout,
        shared: manifest.shared,
        brk: manifest.brk,
        threads: manifest.threads,
        areas: Default::default(),
        attachments: Default::default(),
    };
    for m in manifest.areas {
        let mut area = Area::new(m.map);
        for &(s, e) in &m.runs {
            let off = (s - area.map.start) as usize..(e - area.map.start) as usize;
            body.read_exact(&mut area.data[off])
                .map_err(|e| corrupt(format!("pages: {e}")))?;
            area.mark(s, e);
        }
        image.areas.insert(area.map.start, area);
    }
    for (name, len) in manifest.attachments {
        let mut bytes = vec![0u8; len as usize];
        body.read_exact(&mut bytes)
            .map_err(|e| corrupt(format!("attachment {name}: {e}")))?;
        image.attachments.insert(name, bytes);
    }
    let want = body.crc.clone().finalize();
    let mut sum = [0u8; 4];
    body.inner
        .read_exact(&mut sum)
        .map_err(|e| corrupt(format!("checksum: {e}")))?;
    if u32::from_le_bytes(sum) != want {
        return Err(corrupt("CRC-32 mismatch".into()));
    }
    let mut extra = [0u8; 1];
    match body.inner.read(&mut extra) {
        Ok(0) => Ok(image),
        Ok(_) => Err(corrupt("data after the checksum".into())),
        Err(e) => Err(corrupt(e.to_string())),
    }
}

fn read_full(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..])? {
            0 => break,
            n => got += n,
        }
    }
    Ok(got)
}

/// A reader that hashes what it reads.
struct Checked<R> {
    inner: R,
    crc: crc32fast::Hasher,
}

impl<R: Read> Read for Checked<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.crc.update(&buf[..n]);
        Ok(n)
    }
}

/// Every bound a manifest must keep before anything is allocated for it.
fn validate(m: &Manifest) -> Result<(), String> {
    let aligned = |a: u64| a.is_multiple_of(PAGE);
    let mut span = 0u64;
    let mut last_end = 0u64;
    for a in &m.areas {
        let (s, e) = (a.map.start, a.map.end);
        if !(aligned(s) && aligned(e) && s < e && e <= USER_END) {
            return Err(format!(
                "area {s:#x}-{e:#x} is not a page-aligned user range"
            ));
        }
        if s < last_end {
            return Err(format!("area {s:#x} overlaps the one before"));
        }
        last_end = e;
        span += e - s;
        if span > MAX_SPAN {
            return Err(format!("areas span more than {MAX_SPAN} bytes"));
        }
        let mut at = s;
        for &(rs, re) in &a.runs {
            if !(aligned(rs) && aligned(re) && rs >= at && rs < re && re <= e) {
                return Err(format!(
                    "run {rs:#x}-{re:#x} outside its area or out of order"
                ));
            }
            at = re;
        }
    }
    let attached: u64 = m.attachments.iter().map(|(_, len)| *len).sum();
    if attached > MAX_SPAN {
        return Err(format!("attachments of more than {MAX_SPAN} bytes"));
    }
    if m.threads.is_empty() {
        return Err("no thread".into());
    }
    for l in &m.layout {
        if !(aligned(l.start) && aligned(l.end) && l.start < l.end && l.end <= USER_END) {
            return Err(format!(
                "mapping {:#x}-{:#x} is not a page-aligned user range",
                l.start, l.end
            ));
        }
    }
    Ok(())
}
