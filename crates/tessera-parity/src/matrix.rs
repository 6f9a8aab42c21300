//! Small dense matrices over GF(2^8): enough to build the Reed-Solomon generator and invert
//! its k×k submatrices for decoding.

use crate::gf;

/// A row-major matrix over GF(2^8).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Matrix {
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl Matrix {
    /// The zero matrix.
    pub fn zero(rows: usize, cols: usize) -> Matrix {
        Matrix {
            rows,
            cols,
            data: vec![0; rows * cols],
        }
    }

    /// The identity matrix of size n.
    pub fn identity(n: usize) -> Matrix {
        let mut m = Matrix::zero(n, n);
        for i in 0..n {
            m.set(i, i, 1);
        }
        m
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Element (r, c).
    pub fn get(&self, r: usize, c: usize) -> u8 {
        self.data[r * self.cols + c]
    }

    /// Sets element (r, c).
    pub fn set(&mut self, r: usize, c: usize, v: u8) {
        self.data[r * self.cols + c] = v;
    }

    /// Row r as a slice.
    pub fn row(&self, r: usize) -> &[u8] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// The elements, row-major.
    pub fn as_slice(&self) -> &[u8] {
        &self.data
    }

    /// A matrix made of the given rows of `self`, in that order.
    pub fn select_rows(&self, rows: &[usize]) -> Matrix {
        let mut m = Matrix::zero(rows.len(), self.cols);
        for (i, &r) in rows.iter().enumerate() {
            m.data[i * self.cols..(i + 1) * self.cols].copy_from_slice(self.row(r));
        }
        m
    }

    /// Matrix product `self × rhs`. Panics if the shapes do not match.
    pub fn mul(&self, rhs: &Matrix) -> Matrix {
        assert_eq!(self.cols, rhs.rows, "matrix shapes do not match");
        let mut out = Matrix::zero(self.rows, rhs.cols);
        for r in 0..self.rows {
            for k in 0..self.cols {
                let a = self.get(r, k);
                if a == 0 {
                    continue;
                }
                for c in 0..rhs.cols {
                    out.data[r * rhs.cols + c] ^= gf::mul(a, rhs.get(k, c));
                }
            }
        }
        out
    }

    /// The inverse by Gauss-Jordan elimination, or `None` if the matrix is singular.
    /// Panics if it is not square.
    pub fn invert(&self) -> Option<Matrix> {
        assert_eq!(self.rows, self.cols, "only square matrices have inverses");
        let n = self.rows;
        let mut a = self.clone();
        let mut inv = Matrix::identity(n);
        for col in 0..n {
            let pivot = (col..n).find(|&r| a.get(r, col) != 0)?;
            if pivot != col {
                a.swap_rows(pivot, col);
                inv.swap_rows(pivot, col);
            }
            let f = gf::inv(a.get(col, col));
            a.scale_row(col, f);
            inv.scale_row(col, f);
            for r in 0..n {
                let f = a.get(r, col);
                if r != col && f != 0 {
                    a.add_scaled_row(r, col, f);
                    inv.add_scaled_row(r, col, f);
                }
            }
        }
        Some(inv)
    }

    fn swap_rows(&mut self, a: usize, b: usize) {
        for c in 0..self.cols {
            self.data.swap(a * self.cols + c, b * self.cols + c);
        }
    }

    fn scale_row(&mut self, r: usize, f: u8) {
        for v in &mut self.data[r * self.cols..(r + 1) * self.cols] {
            *v = gf::mul(*v, f);
        }
    }

    /// row[dst] ^= f · row[src]
    fn add_scaled_row(&mut self, dst: usize, src: usize, f: u8) {
        for c in 0..self.cols {
            let v = gf::mul(f, self.get(src, c));
            self.data[dst * self.cols + c] ^= v;
        }
    }
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)] // test matrices: indices below 256
mod tests {
    use super::*;

    #[test]
    fn inverse_times_matrix_is_identity() {
        let mut m = Matrix::zero(5, 5);
        for r in 0..5 {
            for c in 0..5 {
                // Cauchy: 1 / (x_r + y_c) with x_r = r + 5, y_c = c.
                m.set(r, c, gf::inv((r as u8 + 5) ^ c as u8));
            }
        }
        let inv = m.invert().expect("Cauchy matrices are invertible");
        assert_eq!(m.mul(&inv), Matrix::identity(5));
        assert_eq!(inv.mul(&m), Matrix::identity(5));
    }

    #[test]
    fn singular_matrix_has_no_inverse() {
        let mut m = Matrix::identity(3);
        m.set(2, 2, 0);
        m.set(2, 0, 1);
        m.set(0, 0, 1);
        // rows 0 and 2 are now both e_0
        assert!(m.invert().is_none());
    }
}
