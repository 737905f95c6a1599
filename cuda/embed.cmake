# cuda/embed.cmake - turn a binary file into a C array (cmake -P script).
#   -DIN=file -DOUT=file.c -DNAME=symbol
file(READ ${IN} hex HEX)
string(LENGTH "${hex}" n)
math(EXPR size "${n} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," body "${hex}")
string(REGEX REPLACE "((0x[0-9a-f][0-9a-f],){16})" "\\1\n" body "${body}")
file(WRITE ${OUT}
"/* generated from ${IN} by cuda/embed.cmake: do not edit */
#include <stddef.h>
__attribute__((aligned(64))) const unsigned char ${NAME}[] = {
${body}
};
const size_t ${NAME}_size = ${size};
")
